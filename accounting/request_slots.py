"""Per-request footprints in slots, per family: what an engine whose accounts carry no bytes
(vLLM's engine core: `kvledger.engines.vllm.occupancy`) says about its running requests.

`accounting.engine_state` carries SGLang's footprints in bytes; an engine core that counts
blocks and tokens but holds no bytes cannot fill it without claiming 0 bytes per request.
This record says what it knows instead, in each family's own slots:

- `running_requests`: how many requests were running when it was read;
- `families`: per family, every running request's slots in it as a distribution over
  `REQUEST_SLOTS_BUCKETS` (per-bucket counts, the last past every bound; not cumulative)
  and their sum. A slot shared by several requests (a prefix-cache hit) counts in every
  request that holds it, so a family's sum may exceed its occupied slots;
- `requests`: the `MAX_REQUESTS` running requests holding the most slots (all families
  added, which is an order, not a quantity), largest first, each with its slots per family.

The snapshot file carries it as its `request_slots` part (`accounting.snapfile.schema`
checks it, `accounting.snapfile.checks` holds it against the accounts).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from accounting.engine_state import MAX_REQUESTS, MAX_RID

# Upper bounds (slots) of the per-request histogram: 16 to 4Mi slots, x4.
REQUEST_SLOTS_BUCKETS: tuple[int, ...] = tuple(4**i for i in range(2, 12))
BUCKETS = len(REQUEST_SLOTS_BUCKETS) + 1


def clean_rid(rid: object) -> str:
    """A request id as published: at most MAX_RID characters, every character that does not
    print (a control character, a line break) replaced by `?`."""
    text = str(rid)[:MAX_RID]
    return text if text.isprintable() else "".join(c if c.isprintable() else "?" for c in text)


@dataclass(frozen=True)
class FamilyRequests:
    """One family's running requests: their slots as a distribution, and the sum."""

    family: str
    slots_sum: int
    counts: tuple[int, ...]  # per bucket of REQUEST_SLOTS_BUCKETS, the last past every bound

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "slots_sum": self.slots_sum, "counts": list(self.counts)}


@dataclass(frozen=True)
class RequestSlotsHeld:
    """One running request's slots per family (shared ones included)."""

    rid: str  # the engine's request id (clean_rid)
    tokens: int  # tokens whose KV the engine computed for it
    slots_by_family: Mapping[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.slots_by_family.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "rid": self.rid,
            "tokens": self.tokens,
            "slots_by_family": dict(self.slots_by_family),
        }


@dataclass(frozen=True)
class RequestSlots:
    running_requests: int = 0
    families: tuple[FamilyRequests, ...] = ()
    requests: tuple[RequestSlotsHeld, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "running_requests": self.running_requests,
            "families": [f.to_dict() for f in self.families],
            "requests": [r.to_dict() for r in self.requests],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RequestSlots:
        return cls(
            running_requests=d["running_requests"],
            families=tuple(
                FamilyRequests(f["family"], f["slots_sum"], tuple(f["counts"]))
                for f in d.get("families") or ()
            ),
            requests=tuple(
                RequestSlotsHeld(r["rid"], r["tokens"], dict(r.get("slots_by_family") or {}))
                for r in d.get("requests") or ()
            ),
        )


def request_slots(
    families: Sequence[str], running: Iterable[tuple[object, int, Sequence[int]]]
) -> RequestSlots:
    """The record of `running`: each request's (id, tokens, slots in each of `families`, in
    that order). Every request is counted in every family's distribution (0 slots included);
    the `MAX_REQUESTS` largest are listed, ids cleaned (`clean_rid`)."""
    names = tuple(families)
    width = len(names)
    counts = [[0] * BUCKETS for _ in names]
    sums = [0] * width
    bounds, where = REQUEST_SLOTS_BUCKETS, bisect.bisect_left
    top: list[tuple[int, object, int, Sequence[int]]] = []
    for rid, tokens, slots in running:
        if len(slots) != width:
            raise ValueError(
                f"request_slots: request {clean_rid(rid)!r} has {len(slots)} figures, "
                f"expected one per family ({width})"
            )
        for i, n in enumerate(slots):
            counts[i][where(bounds, n)] += 1
            sums[i] += n
        top.append((sum(slots), rid, tokens, slots))
    listed = heapq.nsmallest(MAX_REQUESTS, top, key=lambda t: (-t[0], str(t[1])))
    return RequestSlots(
        running_requests=len(top),
        families=tuple(
            FamilyRequests(name, sums[i], tuple(counts[i])) for i, name in enumerate(names)
        ),
        requests=tuple(
            RequestSlotsHeld(clean_rid(rid), tokens, dict(zip(names, slots, strict=True)))
            for _, rid, tokens, slots in listed
        ),
    )
