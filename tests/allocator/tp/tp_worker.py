"""One TP rank for tests/allocator/tp/test_coordinator.py, run as a script: a pool on the host backend, a
ledger, a TpCoordinator over gloo, and a seeded allocation trace; the outcome goes to a JSON file.

Modes: `trace` runs the trace to the end; `config` gives `--fault-rank` another
max_spare_pages; `diverge-alloc` / `diverge-free` make `--fault-rank`
alloc one slot more / free another allocation at op `--fault-op`; `die` / `hang` make it
SIGKILL itself / sleep there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import the worktree's packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from accounting import Ledger
from allocator import CapacityError, HostBackend, SlotLayout, SwaPool
from allocator.specs import vmm_layer_specs
from allocator.tp import TpCoordinator, TpError

LAYERS = 3
GRANULARITY = 4096
LAYOUT = SlotLayout(capacity_slots=512, slot_bytes=584, page_bytes=GRANULARITY)


def trace(seed: int, ops: int) -> list[tuple[str, int]]:
    """("alloc", n) or ("free", k): free the k-th oldest live allocation (k taken mod live).

    Op 5 allocates 380 slots: about 55 pages, a plan longer than one view carries."""
    rng = random.Random(seed)
    out: list[tuple[str, int]] = []
    for i in range(ops):
        if i == 5:
            out.append(("alloc", 380))
        elif rng.random() < 0.5:
            out.append(("alloc", rng.randint(1, 40)))
        else:
            out.append(("free", rng.randrange(1 << 30)))
    return out


def run_trace(
    pool: SwaPool,
    steps: list[tuple[str, int]],
    *,
    coordinator: TpCoordinator | None = None,
    fault: str = "",
    fault_op: int = -1,
    faulty: bool = False,
    result: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run `steps`; record every alloc's ids (None: CapacityError) and per op
    [exchanges, page ids mapped + unmapped, refused].

    The fault point is the first op from `fault_op` on that the fault can act on (an alloc
    for diverge-alloc, a free with two live allocations for diverge-free, any op else);
    every rank records its exchange count there, and only a `faulty` rank acts."""
    out: dict[str, Any] = result if result is not None else {}
    out.setdefault("allocs", [])
    out.setdefault("ops", [])
    live: list[list[int]] = []
    armed = bool(fault) and fault_op >= 0
    for i, (op, arg) in enumerate(steps):
        hit = False
        if armed and i >= fault_op:
            if fault == "diverge-alloc":
                hit = op == "alloc"
            elif fault == "diverge-free":
                hit = op == "free" and len(live) > 1
            else:
                hit = True
        if hit:
            armed = False
            out["fault_at_op"] = i
            out["exchanges_before_fault"] = (
                coordinator.status().exchanges_total if coordinator else 0
            )
            if faulty and fault == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            if faulty and fault == "hang":
                time.sleep(3600)
        perturb = hit and faulty
        before = _page_counter(pool)
        ex_before = coordinator.status().exchanges_total if coordinator else 0
        ids: list[int] | None = None
        if op == "alloc":
            n = arg + 1 if perturb else arg
            try:
                ids = pool.alloc(n).tolist()
            except CapacityError:
                ids = None
            out["allocs"].append(ids)
            if ids:
                live.append(ids)
        elif live:
            k = arg % len(live)
            if perturb:
                k = (k + 1) % len(live)
            pool.free(live.pop(k))
        ex_after = coordinator.status().exchanges_total if coordinator else 0
        refused = op == "alloc" and ids is None
        out["ops"].append([ex_after - ex_before, _page_counter(pool) - before, refused])
    return out


def _page_counter(pool: SwaPool) -> int:
    stats = pool.stats()
    return stats["pages_mapped_total"] + stats["pages_unmapped_total"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ops", type=int, default=300)
    ap.add_argument("--mode", default="trace")
    ap.add_argument("--fault-rank", type=int, default=-1)
    ap.add_argument("--fault-op", type=int, default=-1)
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--ahead", type=int, default=0)
    args = ap.parse_args()

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{args.store}",
        rank=args.rank,
        world_size=args.size,
        timeout=datetime.timedelta(seconds=30),
    )
    mine = args.rank == args.fault_rank
    result: dict[str, Any] = {"rank": args.rank}
    backend = HostBackend(granularity=GRANULARITY)
    ledger = Ledger(labels={"model_name": "test"})
    pool = None
    account = ledger.add_account(
        vmm_layer_specs(LAYOUT, LAYERS),
        page_bytes=LAYOUT.page_bytes,
    )
    spare = 3 if mine and args.mode == "config" else 2
    pool = SwaPool(backend, layers=LAYERS, layout=LAYOUT, max_spare_pages=spare, observer=account)
    coordinator: TpCoordinator | None = None
    t0 = time.monotonic()
    try:
        coordinator = TpCoordinator(
            pool, timeout_s=args.timeout, ledger=ledger, ahead_pages=args.ahead
        )
        run_trace(
            pool,
            trace(args.seed, args.ops),
            coordinator=coordinator,
            fault="" if args.mode == "trace" else args.mode,
            fault_op=args.fault_op,
            faulty=mine,
            result=result,
        )
        coordinator.verify()
        if not coordinator.wait_idle(10.0):
            raise RuntimeError("pages reserved ahead were not mapped within 10 s")
    except TpError as e:
        result["error"] = type(e).__name__
        result["message"] = str(e)
        result["error_after_s"] = time.monotonic() - t0
        snap = ledger.snapshot()
        result["tp"] = snap.tp.to_dict() if snap.tp else None
        result["exchange_at_error"] = result["tp"]["exchanges_total"] if snap.tp else None
        result["attached"] = coordinator is not None
        result["refused_after"] = _refused_after(pool)
        _write(args.out, result)
        os._exit(0)  # the group is broken: no clean teardown to wait for
    snap = ledger.snapshot()
    result["labels"] = snap.labels
    result["tp"] = snap.tp.to_dict() if snap.tp else None
    result["totals"] = snap.to_dict()["totals"]
    result["violations"] = len(snap.violations)
    result["occupied"] = pool.occupied_ids()
    result["mapped"] = [p for p in range(LAYOUT.num_pages) if pool.is_page_mapped(p)]
    result["stats"] = pool.stats()
    result["reserved"] = sorted(coordinator.pages.reserved)
    result["host_physical"] = backend.physical_bytes()
    assert coordinator is not None
    coordinator.close()
    coordinator.close()
    pool.close()
    after = ledger.snapshot().to_dict()["totals"]
    result["released"] = {
        "physical_bytes": after["physical_bytes"],
        "mapped_bytes": after["mapped_bytes"],
        "occupied_slots": after["occupied_slots"],
        "host_physical": backend.physical_bytes(),
        **backend.stats(),
    }
    backend.close()
    dist.destroy_process_group()
    _write(args.out, result)
    return 0


def _refused_after(pool: SwaPool) -> str:
    try:
        pool.alloc(1)
    except TpError as e:
        return type(e).__name__
    return "not refused"


def _write(path: str, result: dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())
