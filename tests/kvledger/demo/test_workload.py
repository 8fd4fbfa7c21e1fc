# mypy: disable-error-code="union-attr"
from __future__ import annotations

import dataclasses

import pytest

from kvledger.demo.workload import Workload, WorkloadConfig, row_rules
from tests.ledgers import small_ledger


class _Rows:
    def __init__(self, capacity: int) -> None:
        self.capacity_slots = capacity
        self.occupied = 0
        self.peak = 0

    def occupy(self, n: int) -> None:
        self.occupied += n
        assert self.occupied <= self.capacity_slots
        self.peak = max(self.peak, self.occupied)

    def release(self, n: int) -> None:
        self.occupied -= n
        assert self.occupied >= 0


def _run(steps: int, **cfg):
    with small_ledger(slots=4096) as sl:
        rows = {f: _Rows(100_000) for f in row_rules()}
        config = WorkloadConfig(
            rate=50, prompt_tokens=(100, 600), output_tokens=(10, 60), seed=3, **cfg
        )
        w = Workload(sl.pool, rows, config)
        seen_swa = set()
        for _ in range(steps):
            w.step()
            seen_swa.add(sl.swa.occupied_slots)
            for r in w.running:  # a decoding request holds its window plus this step's token
                assert r.generated == 0 or len(r.swa) <= config.window + 1
        stats = w.stats()
        peaks = {f: r.peak for f, r in rows.items()}
        w.close()
        w.close()  # idempotent
        assert sl.swa.occupied_slots == 0
        assert all(r.occupied == 0 for r in rows.values())
        return stats, peaks, seen_swa


def test_requests_flow_and_every_family_moves_then_close_frees_everything():
    stats, peaks, seen_swa = _run(400)
    assert stats["admitted"] > 5 and stats["finished"] > 3
    assert stats["decoded_tokens"] > 100
    assert all(p > 0 for p in peaks.values()), peaks
    assert len(seen_swa) > 10


def test_window_bounds_swa_slots_of_decoding_requests():
    with small_ledger(slots=4096) as sl:
        rows = {f: _Rows(100_000) for f in row_rules()}
        w = Workload(
            sl.pool,
            rows,
            WorkloadConfig(rate=5, prompt_tokens=(300, 300), output_tokens=(200, 200), seed=1),
        )
        for _ in range(100):
            w.step()
        decoding = [r for r in w.running if r.generated > 1]
        assert decoding
        assert all(len(r.swa) == w.config.window + 1 for r in decoding)  # trimmed next step
        assert rows["c4_kv"].occupied == sum(r.tokens // 4 for r in w.running)
        assert rows["c128_state"].occupied == 128 * len(w.running)
        w.close()


def test_admission_waits_when_rows_would_not_fit():
    with small_ledger(slots=4096) as sl:
        rows = {f: _Rows(100_000) for f in row_rules()}
        rows["c128_state"] = _Rows(128)  # room for one running request
        w = Workload(
            sl.pool,
            rows,
            WorkloadConfig(rate=100, prompt_tokens=(50, 50), output_tokens=(500, 500), seed=2),
        )
        for _ in range(20):
            w.step()
        assert len(w.running) == 1
        assert w.stats()["admission_waits"] > 0
        w.close()


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"rate": 0}, "rate"),
        ({"prompt_tokens": (5, 2)}, "prompt_tokens"),
        ({"output_tokens": (0, 2)}, "output_tokens"),
        ({"step_seconds": 0}, "step_seconds"),
        ({"window": 0}, "window"),
    ],
)
def test_bad_config_names_the_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        WorkloadConfig(**kwargs)


def test_shared_prefixes_make_every_holder_move_and_they_add_up():
    """The default workload shares system prompts: cached prefixes are protected while a
    request reuses them, evictable after, evicted past the cache's cap; the holders always
    add up to occupied (the ledger checks it) and the requests' footprints travel."""
    from accounting.ledger import Ledger
    from tests.accounting.helpers import runtime_specs

    ledger = Ledger({"model_name": "w"})
    accounts = {
        f: ledger.add_account(runtime_specs("p", f, 2, rows=200_000, row_bytes=64))
        for f in row_rules()
    }
    with small_ledger(slots=8192) as sl:
        config = WorkloadConfig(
            rate=40,
            prompt_tokens=(50, 200),
            output_tokens=(20, 80),
            prefix_tokens=(300, 600),
            seed=5,
            cache_prefixes=2,
        )
        w = Workload(sl.pool, {**accounts, "swa_kv": sl.swa}, config)

        def engine_state():
            """The footprints in this ledger's families: swa_kv is sl's (a request may not
            claim bytes of a family its ledger does not hold: request_violations)."""
            s = w.engine_state()
            return dataclasses.replace(s, requests=tuple(_without(r, "swa_kv") for r in s.requests))

        ledger.set_engine_state(engine_state)
        seen: set[str] = set()
        seen_swa: set[str] = set()
        for _ in range(600):
            w.step()
            snap = ledger.snapshot()
            assert snap.violations == (), snap.violations
            row = next(a for a in snap.accounts if a.family == "c4_kv")
            seen |= {k for k, v in row.held.to_dict().items() if v}
            swa = sl.ledger.snapshot()
            assert swa.violations == (), swa.violations
            (swa_row,) = [a for a in swa.accounts if a.family == "swa_kv"]
            seen_swa |= {k for k, v in swa_row.held.to_dict().items() if v}
        assert seen == {"tree_protected", "tree_evictable", "request_only"}
        assert seen_swa == {"tree_protected", "tree_evictable", "request_only"}
        stats = w.stats()
        assert stats["prefix_hits"] > 5 and stats["prefix_evictions"] > 0, stats
        assert sum(a.evicted_slots_total for a in ledger.snapshot().accounts) > 0
        assert sl.swa.window_evicted_slots_total > 0
        state = ledger.snapshot().engine
        assert state.running_requests == len(w.running)
        w.close()
        snap = ledger.snapshot()
        assert all(a.occupied_slots == 0 and a.held.total() == 0 for a in snap.accounts)


def _without(r, family: str):
    by = {f: b for f, b in r.bytes_by_family.items() if f != family}
    return dataclasses.replace(r, bytes=sum(by.values()), bytes_by_family=by)


def test_every_runtime_family_of_a_v41_buffer_map_has_a_row_rule():
    """The demo's workload moves V4.1's low-ratio families too (served with a V4.1 config)."""
    from kvledger.engines.sglang.dsv4 import Knobs, plan
    from tests.kvledger.engines.sglang.dsv4.fixtures import v41

    bm = plan(v41(), Knobs(max_running_requests=8), full_tokens=16384)
    assert set(bm.families) - {"swa_kv"} == set(row_rules())
    rules = row_rules()
    assert (rules["c1_kv"](300), rules["c2_kv"](300), rules["c2_state"](300)) == (300, 150, 2)
    assert row_rules(speculative=True)["c2_state"](1) == 8
