"""allocator.tp: ranks as processes (gloo over a file:// store in a temp dir), host backend."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from allocator import HostBackend, SwaPool

sys.path.insert(0, str(Path(__file__).parent))
import contextlib

import tp_worker

WORKER = Path(__file__).with_name("tp_worker.py")
ROOT = WORKER.parents[2]
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
def test_a_killed_rank_makes_the_others_fail_within_the_timeout(tmp_path: Path) -> None:
    results, codes = run_ranks(tmp_path, 2, mode="die", fault_rank=1, fault_op=100, timeout=5.0)
    assert codes[0] == 0 and codes[1] == -9
    r = results[0]
    assert r is not None and r.get("error") == "TpPeerError", r
    assert "rank died or did not answer within timeout_s=5" in r["message"], r["message"]
    assert "Connection closed by peer" in r["message"], r["message"]
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
    assert "timeout_s=2" in r["message"] and "Operation timed out" in r["message"], r["message"]
    assert 1.9 <= failed_after(r["message"]) < 5.0
    assert r["tp"]["peer_failures_total"] == 1
