"""What an engine says beside its accounts about who holds the KV cache, carried in each snapshot.

Filled by an engine's holder reader (`kvledger.engines.sglang.holders` for SGLang); the ledger
only carries it, as it carries `accounting.tp_status.TpStatus`:

- `holders_from`: what the holders were read from (e.g. `UnifiedRadixCache`), empty
  when no reader ran;
- `notes`: what could not be read, one line each (an unknown cache class, a HiCache host
  tier kvledger does not count, a family whose holders are unattributed), at most
  `MAX_NOTES`;
- `retracted_requests_total`: requests the engine retracted for lack of KV room;
- `requests`: the running requests holding the most KV bytes (all families together),
  at most `MAX_REQUESTS`, largest first (`RequestHeld`);
- `running_requests`, `request_bytes_counts`, `request_bytes_sum`: the KV bytes of every
  running request as a distribution over `REQUEST_BYTES_BUCKETS` (per-bucket counts, the
  last one past every bound; not cumulative), what `/metrics` exports instead of ids.

A listed request holds no more than its families can hold (`request_violations`): in each
family at most the family's tensor bytes, over all families at most the source's. Not the
occupied bytes: an engine's footprints come from its token counts, which at a publish can
run a few slots ahead of its allocator's (6 slots of 585 B in SGLang 0.5.23's own objects,
tests/kvledger/engines/sglang/test_holders_sglang.py). A request past what its families can
hold is a counting or reading bug, or a lie (10^15 bytes on a 1,000-byte request): a
violation listed in the snapshot (`accounting.snapshot`), never believed silently.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from accounting.relations import Violation

MAX_NOTES = 16
MAX_NOTE = 512  # characters of one note
MAX_REQUESTS = 20  # requests listed in a snapshot (and so in /debug/kv)
MAX_RID = 128  # characters of a request id kept
# Upper bounds (bytes) of the per-request KV bytes histogram: 1 MiB to 64 GiB, x4.
REQUEST_BYTES_BUCKETS: tuple[int, ...] = tuple(1 << (20 + 2 * i) for i in range(9))


@dataclass(frozen=True)
class RequestHeld:
    """One running request's KV footprint."""

    rid: str  # the engine's request id (cut to MAX_RID characters)
    tokens: int  # tokens it holds KV for (prompt and output so far)
    age_seconds: float  # since the engine received it
    bytes: int  # over all families
    bytes_by_family: Mapping[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["bytes_by_family"] = dict(self.bytes_by_family)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RequestHeld:
        return cls(
            rid=d["rid"],
            tokens=d["tokens"],
            age_seconds=d["age_seconds"],
            bytes=d["bytes"],
            bytes_by_family=dict(d.get("bytes_by_family") or {}),
        )


@dataclass(frozen=True)
class EngineState:
    holders_from: str = ""
    notes: tuple[str, ...] = ()
    retracted_requests_total: int = 0
    running_requests: int = 0
    request_bytes_sum: int = 0
    request_bytes_counts: tuple[int, ...] = (0,) * (len(REQUEST_BYTES_BUCKETS) + 1)
    requests: tuple[RequestHeld, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "holders_from": self.holders_from,
            "notes": list(self.notes),
            "retracted_requests_total": self.retracted_requests_total,
            "running_requests": self.running_requests,
            "request_bytes_sum": self.request_bytes_sum,
            "request_bytes_counts": list(self.request_bytes_counts),
            "requests": [r.to_dict() for r in self.requests],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EngineState:
        return cls(
            holders_from=d.get("holders_from", ""),
            notes=tuple(d.get("notes") or ()),
            retracted_requests_total=d.get("retracted_requests_total", 0),
            running_requests=d.get("running_requests", 0),
            request_bytes_sum=d.get("request_bytes_sum", 0),
            request_bytes_counts=tuple(
                d.get("request_bytes_counts") or (0,) * (len(REQUEST_BYTES_BUCKETS) + 1)
            ),
            requests=tuple(RequestHeld.from_dict(r) for r in d.get("requests") or ()),
        )


@dataclass(frozen=True)
class RequestBytes:
    """Every running request's KV bytes as a distribution: how many (`running`), their sum
    and per-bucket counts over `REQUEST_BYTES_BUCKETS` (the last past every bound)."""

    running: int = 0
    total: int = 0
    counts: tuple[int, ...] = (0,) * (len(REQUEST_BYTES_BUCKETS) + 1)

    @classmethod
    def of(cls, per_request: Iterable[int]) -> RequestBytes:
        counts = [0] * (len(REQUEST_BYTES_BUCKETS) + 1)
        running = total = 0
        for b in per_request:
            counts[bisect.bisect_left(REQUEST_BYTES_BUCKETS, b)] += 1
            running += 1
            total += b
        return cls(running, total, tuple(counts))


def engine_state(
    *,
    holders_from: str,
    notes: Iterable[str] = (),
    retracted_requests_total: int = 0,
    requests: Iterable[RequestHeld] = (),
    distribution: RequestBytes | None = None,
) -> EngineState:
    """An EngineState from the running requests' footprints, the largest `MAX_REQUESTS`
    listed; notes cut to their bounds. Without `distribution`, `requests` is every running
    request and the distribution is theirs; with it (of every running request, taken by
    the caller), `requests` need only hold those that may be listed (at least the
    `MAX_REQUESTS` largest)."""
    listed = list(requests)
    dist = RequestBytes.of(r.bytes for r in listed) if distribution is None else distribution
    if len(listed) > dist.running:
        raise ValueError(
            f"engine_state: {len(listed)} requests listed, expected at most the "
            f"distribution's running={dist.running}"
        )
    top = sorted(listed, key=lambda r: (-r.bytes, r.rid))[:MAX_REQUESTS]
    top = [
        r
        if len(r.rid) <= MAX_RID and math.isfinite(r.age_seconds)
        else dataclasses.replace(
            r,
            rid=r.rid[:MAX_RID],
            age_seconds=r.age_seconds if math.isfinite(r.age_seconds) else 0.0,
        )
        for r in top
    ]
    return EngineState(
        holders_from=holders_from,
        notes=tuple(n[:MAX_NOTE] for n in list(notes)[:MAX_NOTES]),
        retracted_requests_total=retracted_requests_total,
        running_requests=dist.running,
        request_bytes_sum=dist.total,
        request_bytes_counts=dist.counts,
        requests=tuple(top),
    )


# -- what a listed request may claim ------------------------------------------------------
REQUEST_WITHIN_OCCUPIED = "request bytes <= tensor_bytes"
REQUEST_FAMILY_WITHIN_OCCUPIED = "request bytes_by_family <= the family's tensor_bytes"


def request_violations(state: EngineState | None, occupied: Mapping[str, int]) -> list[Violation]:
    """The listed requests that claim more than their families can hold: `occupied` is each
    family's tensor bytes (every owner together; the name is kept from when it was the
    occupied bytes); a request's bytes at most their sum, each of its `bytes_by_family` at
    most its family's (a family not in `occupied` holds 0)."""
    if state is None or not state.requests:
        return []
    total = sum(occupied.values())
    out: list[Violation] = []
    for r in state.requests:
        subject = f"request {r.rid}"
        if r.bytes > total:
            out.append(
                Violation(
                    subject, REQUEST_WITHIN_OCCUPIED, f"bytes={r.bytes}, tensor_bytes={total}"
                )
            )
        for family, nbytes in sorted(r.bytes_by_family.items()):
            held = occupied.get(family, 0)
            if nbytes > held:
                out.append(
                    Violation(
                        subject,
                        REQUEST_FAMILY_WITHIN_OCCUPIED,
                        f"{family}: bytes={nbytes}, tensor_bytes={held}",
                    )
                )
    return out
