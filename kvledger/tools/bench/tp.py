"""`kvledger bench tp`: the cost of a page change with 2 TP ranks over CPU gloo next to one rank.

One run measures, on the host backend (or `--backend cuda`, rank r on GPU r) with a
DeepSeek-V4-shaped SWA pool (43 layers, 2 MiB pages, 584-byte slots in 256-token rows
padded to 576 B):
- alone: one pool without TP, in this process;
- two ranks (processes) over a gloo group on loopback, each timing, interleaved cycle
  by cycle so that all see the same load: a pool without TP ("no TP"), a pool under a
  TpCoordinator ("TP"), and one whose coordinator maps one page ahead ("ahead",
  `ahead_pages=1`; before the timed alloc the bench waits until that page is mapped, as
  a real step's gap between page changes would allow).
The mapped pages are filled first, so each cycle is an alloc(1) that maps a page id
(all its layers), the free of that slot, which unmaps it again (max_spare_pages=0;
one handle set is kept, so no physical memory is created or released in the cycle),
and a free + alloc of one slot that changes no page. Under TP the ranks are lined up
with an untimed exchange before each timed operation. Medians per operation are
printed side by side, with the ratio to the single rank; "exchange" is one forced
exchange (`verify()`), the collective alone.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kvledger.argtypes import number

ROW_TOKENS = 256
SLOT_BYTES = 584
ROW_BYTES = -(-ROW_TOKENS * SLOT_BYTES // 576) * 576  # a row padded to a multiple of 576 B
OPS = ("alloc_map", "free_unmap", "free_alloc_no_page", "exchange")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--layers", type=number(int, 1, 4096), default=43, help="layer buffers (default 43)"
    )
    parser.add_argument(
        "--page-mib", type=number(int, 1, 1024), default=2, help="page size in MiB (default 2)"
    )
    parser.add_argument(
        "--cycles", type=number(int, 1, 1 << 24), default=200, help="measured cycles (default 200)"
    )
    parser.add_argument(
        "--warmup", type=number(int, 0, 1 << 24), default=20, help="unmeasured cycles first"
    )
    parser.add_argument(
        "--timeout",
        type=number(float, 0, 86400, lo_open=True),
        default=60.0,
        help="TP exchange timeout, s",
    )
    parser.add_argument(
        "--backend",
        choices=("host", "cuda"),
        default="host",
        help="host (memfd) or cuda: rank r on GPU r modulo the GPUs present (default host)",
    )
    parser.add_argument("--json", action="store_true", help="print the medians as JSON too")


def run(args: argparse.Namespace) -> int:
    for name in ("layers", "page_mib", "cycles"):
        value = getattr(args, name)
        if value <= 0:
            raise _usage(f"--{name.replace('_', '-')}={value}, expected a positive int")
    if args.warmup < 0:
        raise _usage(f"--warmup={args.warmup}, expected >= 0")
    params = {
        "layers": args.layers,
        "page_bytes": args.page_mib << 20,
        "cycles": args.cycles,
        "warmup": args.warmup,
        "timeout": args.timeout,
        "backend": args.backend,
    }
    if args.backend == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if gpus < 1:
            raise _usage("--backend cuda: no CUDA device is visible")
        params["gpus"] = gpus
    alone = _measure(params, None)
    ranks = _spawn_ranks(params, 2)
    pages = alone["pages_per_change"]
    print(
        f"kvledger bench tp: {args.layers} layers, {args.page_mib} MiB pages, "
        f"{_backend_words(params)}, "
        f"{args.cycles} cycles; a page change maps or unmaps {pages} page id(s) "
        f"({pages * args.layers} layer pages); medians in microseconds"
    )
    cols = (
        "1 rank",
        "no TP r0",
        "TP r0",
        "TP r1",
        "TP/no TP",
        "ahead r0",
        "ahead r1",
        "ahead/no TP",
    )
    print(f"{'operation':<20}" + "".join(f"{c:>12}" for c in cols))
    for op in OPS:
        one = alone["alone"].get(op)
        base = ranks[0]["alone"].get(op)
        r0, r1 = ranks[0]["tp"].get(op), ranks[1]["tp"].get(op)
        a0, a1 = ranks[0]["tp_ahead"].get(op), ranks[1]["tp_ahead"].get(op)
        cells = (
            _us(one),
            _us(base),
            _us(r0),
            _us(r1),
            _ratio(r0, base),
            _us(a0),
            _us(a1),
            _ratio(a0, base),
        )
        print(f"{op:<20}" + "".join(f"{c:>12}" for c in cells))
    if args.json:
        print(json.dumps({"alone": alone, "ranks": ranks}))
    return 0


def _backend_words(params: dict[str, Any]) -> str:
    if params["backend"] != "cuda":
        return "host backend"
    gpus = params["gpus"]
    where = "one GPU per rank" if gpus >= 2 else "both ranks on GPU 0"
    return f"CUDA backend ({where}; 1 rank on GPU 0)"


def _device(params: dict[str, Any], rank: int) -> int:
    return rank % params["gpus"] if params["backend"] == "cuda" else 0


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.0f}"


def _usage(message: str) -> Exception:
    from kvledger.cli import UsageError

    return UsageError(message)


def _layout(page_bytes: int) -> tuple[Any, int]:
    from allocator import SlotLayout

    rows_per_page = page_bytes // ROW_BYTES
    per_page = ROW_TOKENS * rows_per_page  # about one page id of slots
    layout = SlotLayout(
        capacity_slots=per_page * 16,
        slot_bytes=SLOT_BYTES,
        page_bytes=page_bytes,
        slots_per_row=ROW_TOKENS,
        row_bytes=ROW_BYTES,
    )
    return layout, per_page


class _Cycle:
    """One pool filled so that alloc(1) maps a page id; `run` times one cycle."""

    def __init__(
        self, stack: contextlib.ExitStack, params: dict[str, Any], tp: Any, ahead: int = 0
    ) -> None:
        from allocator import HostBackend, SwaPool

        layout, per_page = _layout(params["page_bytes"])
        backend: Any
        if params["backend"] == "cuda":
            from allocator.cuda import CudaBackend

            backend = stack.enter_context(CudaBackend(device=params["device"]))
        else:
            backend = stack.enter_context(HostBackend(granularity=params["page_bytes"]))
        self.pool = stack.enter_context(
            SwaPool(
                backend,
                layers=params["layers"],
                layout=layout,
                max_spare_pages=0,
                handle_pool_pages=1,
            )
        )
        self.coordinator = None
        if tp is not None:
            from allocator.tp import TpCoordinator

            self.coordinator = stack.enter_context(
                TpCoordinator(self.pool, group=tp, timeout_s=params["timeout"], ahead_pages=ahead)
            )
        self.held = _fill_mapped_pages(self.pool, per_page)
        self.pages = 0

    def run(self, sync: Callable[[], Any]) -> dict[str, float]:
        pool = self.pool
        before = pool.stats()["mapped_pages"]
        self._settle(sync)
        t_map, one = _timed(lambda: pool.alloc(1))
        self.pages = pool.stats()["mapped_pages"] - before
        self._settle(sync)
        t_unmap, _ = _timed(lambda: pool.free(one))
        if self.pages <= 0 or pool.stats()["mapped_pages"] != before:
            raise RuntimeError(
                f"bench tp: a cycle mapped {self.pages} page ids and left "
                f"{pool.stats()['mapped_pages']} of {before} mapped; expected a page change "
                "there and back"
            )
        self._settle(sync)

        def free_alloc() -> Any:
            pool.free(self.held[-1:])
            return pool.alloc(1)

        t_small, again = _timed(free_alloc)
        self.held[-1] = int(again[0])
        out = {"alloc_map": t_map, "free_unmap": t_unmap, "free_alloc_no_page": t_small}
        if self.coordinator is not None:
            self._settle(sync)
            out["exchange"], _ = _timed(self.coordinator.verify)
        return out

    def _settle(self, sync: Callable[[], Any]) -> None:
        """Let pages mapped ahead finish (a real step's gap would), then line the ranks up."""
        if self.coordinator is not None:
            self.coordinator.wait_idle()
        sync()

    def release(self) -> None:
        self.pool.free(self.held)


def _measure(params: dict[str, Any], rank_info: tuple[int, int, str] | None) -> dict[str, Any]:
    """Cycles on a pool without TP; with `rank_info` = (rank, size, store) also on a pool
    under TP, interleaved cycle by cycle so that both see the same machine load."""
    times: dict[str, dict[str, list[float]]] = {"alone": {}, "tp": {}, "tp_ahead": {}}
    params = {**params, "device": _device(params, rank_info[0] if rank_info else 0)}
    dist: Any = None
    with contextlib.ExitStack() as stack:
        group = None
        if rank_info is not None:
            import torch.distributed as dist

            rank, size, store = rank_info
            dist.init_process_group(
                "gloo",
                init_method=f"file://{store}",
                rank=rank,
                world_size=size,
                timeout=datetime.timedelta(seconds=params["timeout"]),
            )
            stack.callback(dist.destroy_process_group)
            group = dist.group.WORLD
        cycles = {"alone": _Cycle(stack, params, None)}
        if group is not None:
            cycles["tp"] = _Cycle(stack, params, group)
            cycles["tp_ahead"] = _Cycle(stack, params, group, ahead=1)
        # Under TP every rank lines up before each timed operation, on both pools.
        tp_cycle = cycles.get("tp")
        sync = tp_cycle.coordinator.verify if tp_cycle and tp_cycle.coordinator else _noop
        for i in range(params["warmup"] + params["cycles"]):
            for name, cycle in cycles.items():
                for op, t in cycle.run(sync).items():
                    if i >= params["warmup"]:
                        times[name].setdefault(op, []).append(t)
        for cycle in cycles.values():
            cycle.release()
    out: dict[str, Any] = {
        name: {op: statistics.median(v) for op, v in per_op.items()}
        for name, per_op in times.items()
    }
    out["pages_per_change"] = cycles["alone"].pages
    return out


def _noop() -> None:
    pass


def _fill_mapped_pages(pool: Any, per_page: int) -> list[int]:
    """Occupy every slot of the mapped pages, so that the next alloc(1) maps a page id."""
    held = pool.alloc(per_page).tolist()
    while True:
        before = pool.stats()["mapped_pages"]
        one = pool.alloc(1).tolist()
        if pool.stats()["mapped_pages"] > before:
            pool.free(one)  # that one needed a new page id; freeing it unmaps it again
            return held
        held += one


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def _rank_main(rank: int, params: dict[str, Any], size: int, store: str, out_dir: str) -> None:
    result = _measure(params, (rank, size, store))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _spawn_ranks(params: dict[str, Any], size: int) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="kvledger-bench-tp-") as tmp:
        mp.spawn(
            _rank_main,
            args=(params, size, os.path.join(tmp, "store"), tmp),
            nprocs=size,
            join=True,
        )
        out = []
        for rank in range(size):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                out.append(json.load(f))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvledger bench tp", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
