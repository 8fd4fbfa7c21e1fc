"""Per-request footprints (kvledger.engines.sglang.footprints) equal each family's slots of each
request times its slot bytes, worked out family by family here; the distribution covers
every running request and the listed ones are the largest. Needs no SGLang."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from accounting.engine_state import MAX_REQUESTS, RequestBytes, RequestHeld, engine_state
from kvledger.engines.sglang.footprints import Footprints
from kvledger.engines.sglang.units import FULL, GENERIC_UNITS, REQ, SWA, Units

SWA_CT = "swa-component"  # stands in for SGLang's ComponentType.SWA


@dataclass
class Kv:
    req_pool_idx: int | None
    kv_allocated_len: int
    evicted: dict[Any, int] = field(default_factory=dict)

    def get_evicted_seqlen(self, component: Any) -> int:
        return self.evicted.get(component, 0)


@dataclass
class Req:
    rid: str
    kv: Kv


def dsv4_like(unified: bool) -> list[tuple[str, Units, int]]:
    c4_state = Units(REQ, 8) if unified else Units(SWA, 8, 256)
    return [
        ("swa_kv", Units(SWA), 584 * 8),
        ("c4_kv", Units(FULL, 1, 4), 584 * 2),
        ("c4_indexer", Units(FULL, 1, 4), 132 * 2),
        ("c128_kv", Units(FULL, 1, 128), 584 * 2),
        ("c4_attn_state", c4_state, 4096 * 2),
        ("c4_indexer_state", c4_state, 2048 * 2),
        ("c128_state", Units(REQ, 128), 1024 * 2),
    ]


def expected(families: list[tuple[str, Units, int]], tokens: int, evicted: int) -> dict[str, int]:
    """What each family holds for one request, family by family (no folding)."""
    count = {FULL: tokens, SWA: max(tokens - evicted, 0), REQ: 1}
    return {f: u.of(count[u.space]) * b for f, u, b in families}


def requests(n: int, seed: int) -> list[Req]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tokens = rng.randrange(1, 40_000)
        evicted = rng.choice([0, rng.randrange(0, tokens + 300)])  # past tokens: clamped
        out.append(Req(f"r{i:03d}", Kv(i, tokens, {SWA_CT: evicted} if evicted else {})))
    return out


@pytest.mark.parametrize("unified", [False, True])
@pytest.mark.parametrize("n", [0, 3, MAX_REQUESTS, 3 * MAX_REQUESTS + 7])
def test_footprints_are_exact_per_family_and_the_distribution_covers_everyone(
    unified: bool, n: int
) -> None:
    families = dsv4_like(unified)
    fp = Footprints(families, swa_component=SWA_CT)
    reqs = requests(n, seed=n + unified)
    reqs.append(Req("no-slot", Kv(None, 999)))  # holds no request slot: skipped
    listed, dist = fp.read(reqs, now=100.0)

    held = [r for r in reqs if r.kv.req_pool_idx is not None]
    want = {
        r.rid: expected(families, r.kv.kv_allocated_len, r.kv.get_evicted_seqlen(SWA_CT))
        for r in held
    }
    totals = {rid: sum(by.values()) for rid, by in want.items()}
    assert dist == RequestBytes.of(totals.values())
    assert dist.running == len(held)
    order = sorted(totals, key=lambda rid: (-totals[rid], rid))[:MAX_REQUESTS]
    assert [r.rid for r in listed] == order
    for r in listed:
        assert dict(r.bytes_by_family) == want[r.rid]
        assert r.bytes == totals[r.rid]
        assert r.tokens == next(q.kv.kv_allocated_len for q in held if q.rid == r.rid)
        assert r.age_seconds == 0.0


def test_the_same_as_every_request_held_through_engine_state() -> None:
    families = dsv4_like(False)
    fp = Footprints(families, swa_component=SWA_CT)
    reqs = requests(50, seed=7)
    listed, dist = fp.read(reqs, now=5.0)
    fast = engine_state(holders_from="T", requests=listed, distribution=dist)
    everyone = []
    for r in reqs:
        by = expected(families, r.kv.kv_allocated_len, r.kv.get_evicted_seqlen(SWA_CT))
        everyone.append(RequestHeld(r.rid, r.kv.kv_allocated_len, 0.0, sum(by.values()), by))
    assert fast == engine_state(holders_from="T", requests=everyone)


def test_ages_run_from_when_a_request_was_first_seen_and_finished_ones_are_forgotten() -> None:
    fp = Footprints([("kv", GENERIC_UNITS["kv"], 10)])
    a, b = Req("a", Kv(0, 5)), Req("b", Kv(1, 7))
    fp.read([a], now=10.0)
    listed, _ = fp.read([a, b], now=12.5)
    assert {r.rid: r.age_seconds for r in listed} == {"a": 2.5, "b": 0.0}
    fp.read([b], now=13.0)  # a finished
    listed, _ = fp.read([a, b], now=14.0)  # a again: a new request as far as ages go
    assert {r.rid: r.age_seconds for r in listed} == {"a": 0.0, "b": 1.5}


def test_without_an_swa_component_the_swa_space_counts_every_token() -> None:
    fp = Footprints([("swa_kv", Units(SWA), 3)])
    listed, _ = fp.read([Req("a", Kv(0, 100, {SWA_CT: 60}))], now=0.0)
    assert listed[0].bytes_by_family == {"swa_kv": 300}


def test_a_request_not_shaped_like_sglangs_is_read_from_what_it_has() -> None:
    """Its own kv (no `kv`), no rid (its request slot names it), no evicted lengths; tokens
    from seq_len where kv_allocated_len is 0."""

    @dataclass
    class Loose:
        req_pool_idx: int | None
        kv_allocated_len: int = 0
        seq_len: int = 0

    fp = Footprints([("kv", Units(FULL), 2), ("swa_kv", Units(SWA), 3)], swa_component=SWA_CT)
    listed, dist = fp.read([Loose(4, 10), Loose(5, 0, 7), Loose(None, 99)], now=0.0)
    assert [(r.rid, r.tokens, dict(r.bytes_by_family)) for r in listed] == [
        ("4", 10, {"kv": 20, "swa_kv": 30}),
        ("5", 7, {"kv": 14, "swa_kv": 21}),
    ]
    assert (dist.running, dist.total) == (2, 85)


def test_bad_families_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match=r"family 'kv' slot_bytes=-1, expected an int >= 0"):
        Footprints([("kv", Units(FULL), -1)])
    with pytest.raises(ValueError, match=r"family 'kv' space='tokens', expected one of"):
        Footprints([("kv", Units("tokens"), 1)])


def test_engine_state_refuses_more_listed_than_the_distribution_counts() -> None:
    reqs = [RequestHeld(f"r{i}", 1, 0.0, 1, {}) for i in range(3)]
    with pytest.raises(ValueError, match=r"3 requests listed, expected at most .*running=2"):
        engine_state(holders_from="T", requests=reqs, distribution=RequestBytes.of([1, 1]))
