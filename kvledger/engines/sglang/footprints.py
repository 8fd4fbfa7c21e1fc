"""The running requests' KV footprints, per family, from each request's own lengths.

    fp = Footprints([(family, units, slot_bytes), ...], swa_component=ComponentType.SWA)
    listed, distribution = fp.read(scheduler.running_batch.reqs, time.time())

A request holds, in each family, its tokens converted to that family's slots
(`kvledger.engines.sglang.units.Units`): `kv_allocated_len` tokens in the full-token space,
those less its window-evicted prefix (`get_evicted_seqlen(SWA)`) in the SWA space, one
request slot in the request space; times the family's slot bytes. Those are the counts
SGLang keeps on each request (`ReqKvInfo`); nothing is read from the request-to-token
table or the tree.

What a read costs grows with the running requests, never with tokens or the tree: per
request, a few attribute reads and its total (the families folded into one constant, one
per-token coefficient per space and one floor term per distinct ratio, exact: families
of one ratio floor alike) and one bucket of the distribution; the per-family split and a
`RequestHeld` are built only for the `MAX_REQUESTS` largest, the ones a snapshot lists.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Sequence
from typing import Any

from accounting.engine_state import (
    MAX_REQUESTS,
    REQUEST_BYTES_BUCKETS,
    RequestBytes,
    RequestHeld,
)
from kvledger.engines.sglang.units import FULL, REQ, SWA, Units


class Footprints:
    """Reads the footprints of running requests; remembers when each was first seen (its
    age), forgetting those no longer running."""

    def __init__(
        self, families: Sequence[tuple[str, Units, int]], *, swa_component: Any = None
    ) -> None:
        for family, units, slot_bytes in families:
            if units.space not in (FULL, SWA, REQ):
                raise ValueError(
                    f"Footprints: family {family!r} space={units.space!r}, expected one of "
                    f"{FULL!r}, {SWA!r}, {REQ!r}"
                )
            if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes < 0:
                raise ValueError(
                    f"Footprints: family {family!r} slot_bytes={slot_bytes!r}, expected an int >= 0"
                )
        space = {FULL: 0, SWA: 1, REQ: 2}  # where each space's count sits in _held's tuple
        self._families = tuple((f, space[u.space], u.num, u.den, b) for f, u, b in families)
        # A request's bytes = const + tokens * per_token + swa_tokens * per_swa_token
        #                     + sum(count * num // den * bytes over the floor terms).
        const = per_token = per_swa_token = 0
        floors: dict[tuple[bool, int, int], int] = {}
        for _, units, slot_bytes in families:
            if units.space == REQ:
                const += units.of(1) * slot_bytes
            elif units.den == 1:
                if units.space == SWA:
                    per_swa_token += units.num * slot_bytes
                else:
                    per_token += units.num * slot_bytes
            else:
                key = (units.space == SWA, units.num, units.den)
                floors[key] = floors.get(key, 0) + slot_bytes
        self._const, self._per_token, self._per_swa_token = const, per_token, per_swa_token
        self._floors = tuple((swa, num, den, b) for (swa, num, den), b in floors.items() if b)
        self._uses_swa = any(u.space == SWA for _, u, _ in families)
        self.swa_component = swa_component
        self._first_seen: dict[str, float] = {}

    def read(self, reqs: Iterable[Any], now: float) -> tuple[list[RequestHeld], RequestBytes]:
        """The `MAX_REQUESTS` largest footprints of `reqs` (SGLang `Req`s: `rid` and `kv`,
        a `ReqKvInfo`; or objects that are their own `kv`) and the distribution of all of
        them. Requests holding no request slot are skipped."""
        first_seen = self._first_seen
        seen: dict[str, float] = {}
        const, per_token, per_swa_token = self._const, self._per_token, self._per_swa_token
        floors = self._floors
        swa_ct = self.swa_component if self._uses_swa else None
        buckets = REQUEST_BYTES_BUCKETS
        bucket = bisect.bisect_left
        counts = [0] * (len(buckets) + 1)
        total_bytes = 0
        rows: list[tuple[int, str, int, int, float]] = []
        row = rows.append
        for req in reqs:
            try:  # an SGLang Req: plain attribute reads
                kv = req.kv
                idx = kv.req_pool_idx
                rid = req.rid
                tokens = kv.kv_allocated_len
                evicted = 0 if swa_ct is None else kv.get_evicted_seqlen(swa_ct)
            except AttributeError:  # anything else: what it has
                idx, rid, tokens, evicted = _loose(req, swa_ct)
            if idx is None:
                continue
            if type(rid) is not str:
                rid = str(rid)
            if not tokens:
                tokens = int(getattr(req, "seq_len", 0) or 0)
            swa_tokens = tokens - evicted if tokens > evicted else 0
            b = const + tokens * per_token + swa_tokens * per_swa_token
            for swa, num, den, slot_bytes in floors:
                b += (swa_tokens if swa else tokens) * num // den * slot_bytes
            counts[bucket(buckets, b)] += 1
            total_bytes += b
            first = first_seen.get(rid, now)
            seen[rid] = first
            row((-b, rid, tokens, swa_tokens, first))
        self._first_seen = seen
        listed = [
            self._held(rid, tokens, swa_tokens, max(now - first, 0.0))
            for _, rid, tokens, swa_tokens, first in heapq.nsmallest(MAX_REQUESTS, rows)
        ]
        return listed, RequestBytes(len(rows), total_bytes, tuple(counts))

    def _held(self, rid: str, tokens: int, swa_tokens: int, age: float) -> RequestHeld:
        count = (tokens, swa_tokens, 1)
        by_family = {
            family: count[space] * num // den * slot_bytes
            for family, space, num, den, slot_bytes in self._families
        }
        return RequestHeld(rid, tokens, age, sum(by_family.values()), by_family)


def _loose(req: Any, swa_ct: Any) -> tuple[Any, Any, int, int]:
    """(request slot, id, tokens, SWA-evicted tokens) of a request not shaped like SGLang's."""
    kv = getattr(req, "kv", req)
    idx = getattr(kv, "req_pool_idx", None)
    rid = getattr(req, "rid", idx)
    tokens = int(getattr(kv, "kv_allocated_len", 0) or 0)
    get = None if swa_ct is None else getattr(kv, "get_evicted_seqlen", None)
    return idx, rid, tokens, int(get(swa_ct)) if get is not None else 0
