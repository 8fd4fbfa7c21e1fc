"""allocator.tp: ranks as processes (gloo over a file:// store in a temp dir), host backend."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from accounting import Ledger, Snapshot
from allocator import BackgroundMapper, CapacityError, HostBackend, SwaPool
from allocator.tp import PLAN_WORDS, TpCoordinator

sys.path.insert(0, str(Path(__file__).parent))
import tp_worker

from allocator.specs import vmm_layer_specs

WORKER = Path(__file__).with_name("tp_worker.py")
ROOT = WORKER.parents[3]
OPS = 300
SEED = 7


def run_ranks(
    tmp_path: Path,
    size: int,
    *,
    mode: str = "trace",
    fault_rank: int = -1,
    fault_op: int = -1,
    timeout: float = 20.0,
    wait_s: float = 50.0,
    ahead: int = 0,
) -> tuple[list[dict[str, Any] | None], list[int | None]]:
    """Start `size` ranks, wait up to `wait_s`, kill what is left; (results, exit codes)."""
    procs = []
    for rank in range(size):
        cmd = [
            sys.executable,
            str(WORKER),
            f"--rank={rank}",
            f"--size={size}",
            f"--store={tmp_path / 'store'}",
            f"--out={tmp_path / f'rank{rank}.json'}",
            f"--seed={SEED}",
            f"--ops={OPS}",
            f"--mode={mode}",
            f"--fault-rank={fault_rank}",
            f"--fault-op={fault_op}",
            f"--timeout={timeout}",
            f"--ahead={ahead}",
        ]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + wait_s
    codes: list[int | None] = [None] * size
    try:  # the ranks that should end first; a hung rank is then killed
        for rank in sorted(range(size), key=lambda r: (mode == "hang" and r == fault_rank, r)):
            if mode == "hang" and rank == fault_rank:
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                codes[rank] = procs[rank].wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for rank in range(size):
        f = tmp_path / f"rank{rank}.json"
        results.append(json.loads(f.read_text()) if f.exists() else None)
    for p, r in zip(procs, results, strict=True):
        if r is None and p.stderr is not None:
            sys.stderr.write(p.stderr.read()[-3000:])
    return results, codes


def failed_after(message: str) -> float:
    m = re.search(r"failed after ([0-9.]+) s", message)
    assert m is not None, message
    return float(m.group(1))


def reference_allocs() -> list[list[int] | None]:
    """The same trace on one pool without TP: what rank 0's policy hands out alone."""
    with (
        HostBackend(granularity=tp_worker.GRANULARITY) as backend,
        SwaPool(
            backend, layers=tp_worker.LAYERS, layout=tp_worker.LAYOUT, max_spare_pages=2
        ) as pool,
    ):
        out = tp_worker.run_trace(pool, tp_worker.trace(SEED, OPS))
    return out["allocs"]


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 4])
def test_ranks_follow_rank0_to_the_same_ids_pages_and_figures(tmp_path: Path, size: int) -> None:
    results, codes = run_ranks(tmp_path, size)
    assert codes == [0] * size, codes
    r0 = results[0]
    assert r0 is not None and "error" not in r0, r0
    assert r0["allocs"] == reference_allocs()  # TP leaves rank 0's policy unchanged
    big = r0["ops"][5]
    assert big[0] == 1 and big[1] > PLAN_WORDS  # one exchange, in several rounds
    refused = sum(1 for a in r0["allocs"] if a is None)
    changed = sum(1 for _, pages, _ in r0["ops"] if pages)
    assert 0 < refused < 20 and 0 < changed < len(r0["ops"]) // 2, (refused, changed)
    for rank, r in enumerate(results):
        assert r is not None and "error" not in r, r
        assert r["labels"]["tp_rank"] == str(rank)
        assert r["tp"]["rank"] == rank and r["tp"]["size"] == size
        assert r["tp"]["divergences_total"] == 0 and r["tp"]["peer_failures_total"] == 0
        for key in ("allocs", "occupied", "mapped", "stats", "totals", "host_physical"):
            assert r[key] == r0[key], (rank, key)
        assert r["tp"]["exchanges_total"] == r0["tp"]["exchanges_total"]
        # An op exchanges once when it changes pages or rank 0 refuses it, else never.
        assert all(ex == int(bool(pages) or refused) for ex, pages, refused in r["ops"])
        assert r["violations"] == 0
        assert r["totals"]["physical_bytes"] == r["host_physical"] == r["stats"]["physical_bytes"]
        assert r["totals"]["occupied_slots"] == len(r["occupied"])
        rel = r["released"]
        assert rel["physical_bytes"] == rel["mapped_bytes"] == rel["occupied_slots"] == 0
        assert rel["host_physical"] == 0 and rel["mappings"] == 0 and rel["handles"] == 0
        assert rel["reservations"] == 0
    # hello + one per page-changing or refused op + the final verify
    assert r0["tp"]["exchanges_total"] == changed + refused + 2


@pytest.mark.slow
@pytest.mark.parametrize(("size", "ahead"), [(2, 3), (4, 2)])
def test_ranks_mapping_ahead_follow_rank0_to_the_same_ids_pages_and_figures(
    tmp_path: Path, size: int, ahead: int
) -> None:
    results, codes = run_ranks(tmp_path, size, ahead=ahead)
    assert codes == [0] * size, codes
    r0 = results[0]
    assert r0 is not None and "error" not in r0, r0
    assert len(r0["reserved"]) == ahead
    # Published pages mapped ahead: an exchange with no map on the allocation path.
    assert any(ex == 1 and pages == 0 and not refused for ex, pages, refused in r0["ops"])
    for r in results:
        assert r is not None and "error" not in r, r
        for key in ("allocs", "occupied", "mapped", "reserved", "stats", "totals"):
            assert r[key] == r0[key], (r["rank"], key)
        assert r["tp"]["exchanges_total"] == r0["tp"]["exchanges_total"]
        assert r["tp"]["divergences_total"] == 0 and r["violations"] == 0
        assert r["totals"]["physical_bytes"] == r["host_physical"] == r["stats"]["physical_bytes"]
        assert r["stats"]["busy_pages"] == 0
        rel = r["released"]
        assert rel["physical_bytes"] == rel["mapped_bytes"] == rel["occupied_slots"] == 0
        assert rel["host_physical"] == 0 and rel["mappings"] == 0 and rel["handles"] == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("size", "fault_rank", "mode"),
    [(2, 1, "diverge-alloc"), (2, 1, "diverge-free"), (4, 2, "diverge-free")],
)
def test_divergence_is_caught_at_the_next_exchange_on_every_rank(
    tmp_path: Path, size: int, fault_rank: int, mode: str
) -> None:
    results, codes = run_ranks(tmp_path, size, mode=mode, fault_rank=fault_rank, fault_op=150)
    assert codes == [0] * size, codes
    for _rank, r in enumerate(results):
        assert r is not None
        assert r.get("error") == "TpDivergenceError", r
        assert r["exchange_at_error"] == r["exchanges_before_fault"] + 1
        msg = r["message"]
        assert "rank 0: " in msg and f"rank {fault_rank}: " in msg, msg
        assert f"rank {fault_rank} differs from rank 0 in: " in msg, msg
        assert r["tp"]["divergences_total"] == 1 and r["tp"]["last_error"] == msg
        assert r["refused_after"] == "TpDivergenceError"


@pytest.mark.slow
def test_a_rank_with_another_pool_configuration_is_refused_at_attach(tmp_path: Path) -> None:
    results, codes = run_ranks(tmp_path, 2, mode="config", fault_rank=1)
    assert codes == [0, 0], codes
    for r in results:
        assert r is not None and r.get("error") == "TpDivergenceError", r
        assert r["exchange_at_error"] == 1 and not r["attached"]
        assert "differs from rank 0 in: config" in r["message"], r["message"]
        assert "hello between ops" in r["message"], r["message"]
        assert "configured differently" in r["message"], r["message"]
        assert r["tp"]["divergences_total"] == 1
        assert r["refused_after"] == "not refused"  # the pool was left detached, usable alone


@pytest.mark.slow
def test_a_killed_rank_makes_the_others_fail_within_the_timeout(tmp_path: Path) -> None:
    results, codes = run_ranks(tmp_path, 2, mode="die", fault_rank=1, fault_op=100, timeout=5.0)
    assert codes[0] == 0 and codes[1] == -9
    r = results[0]
    assert r is not None and r.get("error") == "TpPeerError", r
    assert "rank died or did not answer within timeout_s=5" in r["message"], r["message"]
    assert failed_after(r["message"]) < 5.0
    assert r["tp"]["peer_failures_total"] == 1
    assert r["refused_after"] == "TpPeerError"


@pytest.mark.slow
def test_a_hung_rank_makes_the_others_fail_after_the_timeout(tmp_path: Path) -> None:
    results, codes = run_ranks(
        tmp_path, 2, mode="hang", fault_rank=1, fault_op=100, timeout=2.0, wait_s=30.0
    )
    assert codes[0] == 0
    r = results[0]
    assert r is not None and r.get("error") == "TpPeerError", r
    # gloo names the side that gave up: "Operation timed out" (a receive) or "Timed out
    # waiting 2000ms for send operation" (a send), whichever the hung peer left waiting
    assert "timeout_s=2" in r["message"] and "timed out" in r["message"].lower(), r["message"]
    assert 1.9 <= failed_after(r["message"]) < 5.0
    assert r["tp"]["peer_failures_total"] == 1


# -- one rank in this process: attach rules and what the pool and ledger show -------------


@pytest.fixture
def world1(tmp_path: Path) -> Any:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'w1'}", rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


@pytest.fixture
def pool() -> Any:
    with (
        HostBackend(granularity=tp_worker.GRANULARITY) as backend,
        SwaPool(backend, layers=2, layout=tp_worker.LAYOUT, max_spare_pages=1) as p,
    ):
        yield p


def test_attach_needs_torch_distributed(pool: SwaPool) -> None:
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialized"):
        TpCoordinator(pool)


def test_attach_refuses_bad_timeout_and_a_pool_with_a_mapper(world1: Any, pool: SwaPool) -> None:
    with pytest.raises(ValueError, match="timeout_s=0, expected a positive"):
        TpCoordinator(pool, timeout_s=0)
    with BackgroundMapper(pool), pytest.raises(ValueError, match="has a background mapper"):
        TpCoordinator(pool)


def test_an_attached_pool_refuses_a_mapper_occupy_and_a_second_group(
    world1: Any, pool: SwaPool
) -> None:
    with TpCoordinator(pool, timeout_s=5) as tp:
        with pytest.raises(ValueError, match="follows a TP group"):
            BackgroundMapper(pool)
        with pytest.raises(RuntimeError, match="occupy: not supported while the pool follows"):
            pool.occupy([5])
        with pytest.raises(ValueError, match="already follows a TP group"):
            TpCoordinator(pool)
        assert tp.rank == 0 and tp.size == 1
    assert pool.store.tp is None
    pool.occupy([5])  # detached: the pool works alone again
    pool.free([5])


def test_a_single_rank_group_exchanges_only_on_page_changes(world1: Any, pool: SwaPool) -> None:
    ledger = Ledger(labels={"model_name": "m"})
    with TpCoordinator(pool, timeout_s=5, ledger=ledger) as tp:
        assert tp.status().exchanges_total == 1  # the configuration handshake
        a = pool.alloc(20)  # more than page 0 (the null slot's) holds: maps pages
        after_map = tp.status().exchanges_total
        assert after_map == 2
        pool.free(a[:1])  # leaves its page in use: no page change
        b = pool.alloc(1)  # takes that slot back: no page change
        assert b.tolist() == a[:1].tolist()
        assert tp.status().exchanges_total == after_map
        tp.verify()
        snap = ledger.snapshot()
        assert snap.labels == {"model_name": "m", "tp_rank": "0"}
        assert snap.tp is not None and snap.tp.exchanges_total == after_map + 1
        assert snap.tp.page_ops_total >= 1 and snap.tp.divergences_total == 0
        assert Snapshot.from_dict(snap.to_dict()).tp == snap.tp
        pool.free(a)
        assert tp.status().exchanges_total > after_map + 1  # emptied pages were unmapped
    tp.close()  # idempotent


def test_a_ledger_labelled_for_another_rank_is_refused(world1: Any, pool: SwaPool) -> None:
    with pytest.raises(ValueError, match="tp_rank='3', expected '0'"):
        TpCoordinator(pool, ledger=Ledger(labels={"tp_rank": "3"}))
    assert pool.store.tp is None


def test_rank0_refusal_is_a_capacity_error_and_changes_nothing(world1: Any) -> None:
    layout = tp_worker.LAYOUT
    with (
        HostBackend(granularity=tp_worker.GRANULARITY) as backend,
        SwaPool(backend, layers=1, layout=layout, physical_budget=2 * layout.page_bytes) as p,
        TpCoordinator(p, timeout_s=5) as tp,
    ):
        before = p.stats()
        with pytest.raises(CapacityError, match="TP rank 0 decides"):
            p.alloc(layout.capacity_slots - 1)
        assert p.stats() == before
        assert tp.failed is None
        assert len(p.alloc(3)) == 3  # the slots gathered before the refusal are still free


def _ledger_pool(backend: HostBackend, **kw: Any) -> tuple[Ledger, Any, SwaPool]:
    layout = tp_worker.LAYOUT
    ledger = Ledger()
    account = ledger.add_account(vmm_layer_specs(layout, 2), page_bytes=layout.page_bytes)
    return ledger, account, SwaPool(backend, layers=2, layout=layout, observer=account, **kw)


def test_pages_mapped_ahead_are_published_without_a_map_on_the_allocation_path(
    world1: Any,
) -> None:
    with HostBackend(granularity=tp_worker.GRANULARITY) as backend:
        ledger, account, pool = _ledger_pool(backend, max_spare_pages=4)
        with pool, TpCoordinator(pool, timeout_s=5, ahead_pages=2) as tp:
            assert tp.wait_idle(5.0)
            reserved = sorted(tp.pages.reserved)
            assert (
                len(reserved) == 2
                and [tp.pages.page_state(p) for p in reserved] == ["reserved"] * 2
            )
            assert account.mapped_pages == 1 + 2  # the null slot's page and the two ahead
            calls: list[tuple[str, int]] = []
            real_map = pool.store.pages.map_page

            def map_page(page: int, handles: Any) -> None:
                calls.append((threading.current_thread().name, page))
                real_map(page, handles)

            pool.store.pages.map_page = map_page  # type: ignore[method-assign]
            ids = pool.alloc(10)  # page 0 holds 6 more: it needs a reserved page
            assert pool.is_page_mapped(reserved[0])
            assert len(tp.pages.reserved) == 2  # topped up at the end of the op
            assert tp.wait_idle(5.0)
            main = threading.current_thread().name
            assert [p for name, p in calls if name == main] == []  # published, not mapped here
            assert [p for _, p in calls] == [max(tp.pages.reserved)]  # the top-up, by the thread
            pool.free(ids)
            assert pool.stats()["physical_bytes"] == account.handle_pages * pool.set_bytes
        # pool.close() closed the coordinator first: the reserve is given back
        totals = ledger.snapshot().to_dict()["totals"]
        assert totals["physical_bytes"] == totals["mapped_bytes"] == 0
        assert backend.physical_bytes() == 0 and backend.stats()["mappings"] == 0


def test_detaching_gives_the_reserved_pages_back_and_the_pool_works_alone(world1: Any) -> None:
    with HostBackend(granularity=tp_worker.GRANULARITY) as backend:
        _, account, pool = _ledger_pool(backend, max_spare_pages=1, handle_pool_pages=0)
        with pool:
            with TpCoordinator(pool, timeout_s=5, ahead_pages=3) as tp:
                tp.wait_idle(5.0)
                assert account.mapped_pages == 4
            assert pool.store.tp is None and not tp.pages.reserved
            assert account.mapped_pages == 1 and account.handle_pages == 1
            assert pool.stats()["live_handle_sets"] == 1
            assert len(pool.alloc(20)) == 20
        assert backend.physical_bytes() == 0


def test_mapping_ahead_stays_within_the_physical_budget(world1: Any) -> None:
    layout = tp_worker.LAYOUT
    with HostBackend(granularity=tp_worker.GRANULARITY) as backend:
        _, _, pool = _ledger_pool(backend, physical_budget=3 * 2 * layout.page_bytes)
        with pool, TpCoordinator(pool, timeout_s=5, ahead_pages=5) as tp:
            assert len(tp.pages.reserved) == 2  # the null slot's page holds the third set
            tp.wait_idle(5.0)
            assert pool.stats()["physical_bytes"] <= 3 * 2 * layout.page_bytes


def test_ahead_pages_must_be_a_non_negative_int(world1: Any, pool: SwaPool) -> None:
    with pytest.raises(ValueError, match="ahead_pages=-1, expected an int >= 0"):
        TpCoordinator(pool, ahead_pages=-1)
