"""`kvledger bench alloc`: the SWA pool's allocation path, measured side by side in one run.

1. Hot-path alloc+free on pages already mapped: decode-like (256 requests x 1 slot
   per step) and prefill-like (4096 slots in one call).
2. Mapping one page id across all layers: kvledger's pool next to the bare floor
   (CUDA: raw driver calls with pooled handles, and naive create + map + set-access;
   host: the backend's own calls).
3. Allocation latency while the pool grows under a steady decode load, with the
   background mapper on and off, and how many allocations called the driver.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from accounting import Ledger
from allocator import BackgroundMapper, SlotLayout, SwaPool
from allocator.backend import Backend
from allocator.specs import vmm_layer_specs
from kvledger.argtypes import number
from kvledger.gc_clock import GcClock

# DeepSeek-V4 SWA geometry (docs/background.md#deepseek-v4-geometry): 584-byte tokens, 256 per page, pages padded to 576 B multiples.
SWA_SLOT_BYTES = 584
SWA_SLOTS_PER_ROW = 256
SWA_ROW_BYTES = -(-SWA_SLOT_BYTES * SWA_SLOTS_PER_ROW // 576) * 576


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("host", "cuda"), default="host")
    p.add_argument("--layers", type=number(int, 1, 4096), default=43)
    p.add_argument(
        "--capacity",
        type=number(int, 4097, 1 << 31),
        default=262_144,
        help="SWA slots (tokens) in the pool",
    )
    p.add_argument(
        "--steps", type=number(int, 1, 1 << 24), default=400, help="decode steps per measured phase"
    )
    p.add_argument(
        "--page-repeats",
        type=number(int, 1, 1 << 16),
        default=30,
        help="page ids mapped per map measurement",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON too")


class CountingBackend:
    """Wraps a backend and counts driver calls made on one thread (the allocating one)."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name
        self.granularity = inner.granularity
        self.watch_thread: int | None = None
        self.calls = 0

    def _count(self) -> None:
        if threading.get_ident() == self.watch_thread:
            self.calls += 1

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name in {
            "reserve",
            "free_reservation",
            "create",
            "release",
            "map",
            "unmap",
            "set_access",
        }:

            def counted(*a: Any, **k: Any) -> Any:
                self._count()
                return attr(*a, **k)

            return counted
        return attr


def _backend(kind: str) -> Backend:
    if kind == "cuda":
        from kvledger.cli import UsageError

        try:
            from allocator.cuda import CudaBackend
        except ImportError as e:
            raise UsageError(
                f"--backend cuda is not available here ({e}); it needs an NVIDIA GPU and "
                "kvledger's cuda extra (pip install 'kvledger[cuda]')"
            ) from None
        try:
            return CudaBackend()
        except RuntimeError as e:
            raise UsageError(f"--backend cuda: {' '.join(str(e).split())}") from None
    from allocator.host import HostBackend

    return HostBackend()


def _layout(capacity: int, page_bytes: int) -> SlotLayout:
    return SlotLayout(
        capacity_slots=capacity,
        slot_bytes=SWA_SLOT_BYTES,
        page_bytes=page_bytes,
        slots_per_row=SWA_SLOTS_PER_ROW,
        row_bytes=SWA_ROW_BYTES,
    )


def _ledger_account(layout: SlotLayout, layers: int) -> Any:
    specs = vmm_layer_specs(layout, layers)
    return Ledger().add_account(specs, page_bytes=layout.page_bytes)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _us(x: float) -> str:
    return f"{x * 1e6:9.1f} us"


def hot_path(backend: Backend, layers: int, capacity: int, steps: int) -> dict[str, float]:
    layout = _layout(capacity, backend.granularity)
    out: dict[str, float] = {}
    with SwaPool(
        backend,
        layers=layers,
        layout=layout,
        max_spare_pages=layout.num_pages,
        observer=_ledger_account(layout, layers),
    ) as pool:
        warm = pool.alloc(min(capacity - 1, 256 * 16 + 4096))
        pool.free(warm)  # pages stay mapped as spares: the hot path finds them
        decode: list[float] = []
        for _ in range(steps):
            t0 = time.perf_counter()
            ids = [pool.alloc(1) for _ in range(256)]
            for t in ids:
                pool.free(t)
            decode.append((time.perf_counter() - t0) / 512)
        prefill: list[float] = []
        for _ in range(max(10, steps // 10)):
            t0 = time.perf_counter()
            t = pool.alloc(4096)
            pool.free(t)
            prefill.append(time.perf_counter() - t0)
    out["decode_op_median_s"] = statistics.median(decode)
    out["decode_ops_per_s"] = 1 / out["decode_op_median_s"]
    out["prefill_4096_median_s"] = statistics.median(prefill)
    out["prefill_slots_per_s"] = 4096 * 2 / out["prefill_4096_median_s"]
    return out


def page_map(backend: Backend, layers: int, repeats: int) -> dict[str, float]:
    """Median seconds to map one page id in all layers: the pool vs the floor, pooled handles.

    The three are interleaved round by round, so drift in the machine hits them alike.
    """
    page = backend.granularity
    layout = _layout(repeats * (page // SWA_SLOT_BYTES), page)
    floor = _floor_fn(backend)
    kv: list[float] = []
    pooled: list[float] = []
    naive: list[float] = []
    with SwaPool(
        backend,
        layers=layers,
        layout=layout,
        max_spare_pages=0,
        handle_pool_pages=repeats,
        null_slot=False,
    ) as pool:
        # Fill the handle pool: map every page once, then free so each unmaps and keeps its set.
        first_slots = [layout.first_slot_at(p * page) for p in range(layout.num_pages)]
        pool.occupy(first_slots)
        pool.free(first_slots)
        for s in first_slots[:repeats]:
            t0 = time.perf_counter()
            pool.occupy([s])
            kv.append(time.perf_counter() - t0)
            pool.free([s])
            pooled += floor(layers, 1, False)
            naive += floor(layers, 1, True)
    out = {
        "kvledger_pooled_s": statistics.median(kv),
        "floor_pooled_s": statistics.median(pooled),
        "floor_naive_s": statistics.median(naive),
    }
    out["ratio_vs_pooled_floor"] = out["kvledger_pooled_s"] / out["floor_pooled_s"]
    return out


def _floor_fn(backend: Backend) -> Callable[[int, int, bool], list[float]]:
    """The bare floor: raw driver calls on CUDA; the backend's own calls on the host."""
    if backend.name == "cuda":
        from kvledger.tools.bench.driver_floor import driver_floor_seconds

        page = backend.granularity
        return lambda layers, repeats, naive: driver_floor_seconds(
            backend, layers=layers, page_bytes=page, repeats=repeats, naive=naive
        )
    return lambda layers, repeats, naive: _backend_floor(backend, layers, repeats, naive=naive)


def _backend_floor(backend: Backend, layers: int, repeats: int, *, naive: bool) -> list[float]:
    page = backend.granularity
    bases = [backend.reserve(page * repeats) for _ in range(layers)]
    pooled = [] if naive else [backend.create(page) for _ in range(layers)]
    out = []
    try:
        for r in range(repeats):
            t0 = time.perf_counter()
            handles = [backend.create(page) for _ in range(layers)] if naive else pooled
            for layer in range(layers):
                backend.map(bases[layer] + r * page, page, handles[layer])
                backend.set_access(bases[layer] + r * page, page)
            out.append(time.perf_counter() - t0)
            for layer in range(layers):
                backend.unmap(bases[layer] + r * page, page)
            if naive:
                for h in handles:
                    backend.release(h)
    finally:
        for h in pooled:
            backend.release(h)
        for b in bases:
            backend.free_reservation(b, page * repeats)
    return out


def growth_latency(
    backend: Backend, layers: int, capacity: int, steps: int, *, mapper: bool
) -> dict[str, float]:
    """alloc(1) latency under a steady decode load that keeps needing new pages."""
    counting = CountingBackend(backend)
    layout = _layout(capacity, backend.granularity)
    opts: dict[str, Any] = (
        {"min_spare_pages": 4, "max_spare_pages": 8}
        if mapper
        else {"min_spare_pages": 0, "max_spare_pages": 1}
    )
    lat: list[float] = []
    calls_before: list[int] = []
    collections: list[int] = []  # garbage collections that ran during each alloc
    clock = GcClock()
    with SwaPool(
        counting, layers=layers, layout=layout, observer=_ledger_account(layout, layers), **opts
    ) as pool:
        bg = BackgroundMapper(pool) if mapper else None
        try:
            if bg:
                bg.wait_idle()
            counting.watch_thread = threading.get_ident()
            requests = 256
            # The slots stay held, as an engine holds them: as ids in its own index tensor,
            # not as one Python tensor object per alloc, which the garbage collector would
            # walk (100k of them made full collections of ~100 ms land on this thread).
            held = 0
            clock.install()
            for _ in range(steps):
                for _ in range(requests):
                    c0, g0 = counting.calls, clock.count
                    t0 = time.perf_counter()
                    got = pool.alloc(1)
                    lat.append(time.perf_counter() - t0)
                    calls_before.append(counting.calls - c0)
                    collections.append(clock.count - g0)
                    held += int(got.numel())
                if held > capacity * 0.8:
                    break
                # the decode step itself takes time; let the mapper run as a real engine would
                time.sleep(0.002)
            counting.watch_thread = None
        finally:
            clock.close()
            if bg:
                bg.close()
    with_calls = sum(1 for c in calls_before if c)
    with_gc = [x for x, c in zip(lat, collections, strict=True) if c]
    return {
        "allocs": len(lat),
        "p50_s": _pct(lat, 0.50),
        "p99_s": _pct(lat, 0.99),
        "p999_s": _pct(lat, 0.999),
        "max_s": max(lat),
        "allocs_calling_driver": with_calls,
        "allocs_with_gc": len(with_gc),
        "max_with_gc_s": max(with_gc, default=0.0),
    }


def run(args: argparse.Namespace) -> int:
    from kvledger.cli import UsageError

    if args.layers <= 0 or args.capacity <= 4096 or args.steps <= 0 or args.page_repeats <= 0:
        raise UsageError(
            f"--layers={args.layers} --capacity={args.capacity} --steps={args.steps} "
            f"--page-repeats={args.page_repeats}: expected layers > 0, capacity > 4096, "
            "steps > 0, page repeats > 0"
        )
    backend = _backend(args.backend)
    results: dict[str, Any] = {
        "backend": args.backend,
        "layers": args.layers,
        "granularity": backend.granularity,
    }
    try:
        print(
            f"kvledger bench alloc: backend={args.backend} layers={args.layers} page={backend.granularity} B capacity={args.capacity} slots"
        )
        hp = hot_path(backend, args.layers, args.capacity, args.steps)
        results["hot_path"] = hp
        print("\n[1] hot path (pages already mapped)")
        print(
            f"  decode  alloc(1)/free(1) per op median {_us(hp['decode_op_median_s'])}  ({hp['decode_ops_per_s']:,.0f} ops/s)"
        )
        print(
            f"  prefill alloc(4096)+free       median {_us(hp['prefill_4096_median_s'])}  ({hp['prefill_slots_per_s']:,.0f} slots/s)"
        )
        pm = page_map(backend, args.layers, args.page_repeats)
        results["page_map"] = pm
        print(f"\n[2] map one page id across {args.layers} layers (median of {args.page_repeats})")
        print(f"  kvledger pool (pooled handles)     {_us(pm['kvledger_pooled_s'])}")
        print(f"  floor: map + set-access (pooled)   {_us(pm['floor_pooled_s'])}")
        print(f"  floor: create + map + set-access   {_us(pm['floor_naive_s'])}")
        print(
            f"  ratio kvledger / pooled floor      {pm['ratio_vs_pooled_floor']:9.3f}x   (target <= 1.10x)"
        )
        print("\n[3] alloc(1) latency while the pool grows (256 requests decoding)")
        for mapper in (True, False):
            g = growth_latency(backend, args.layers, args.capacity, args.steps, mapper=mapper)
            results[f"growth_mapper_{'on' if mapper else 'off'}"] = g
            print(
                f"  mapper {'on ' if mapper else 'off'}: p50 {_us(g['p50_s'])}  p99 {_us(g['p99_s'])}  p99.9 {_us(g['p999_s'])}  max {_us(g['max_s'])}  "
                f"allocs calling the driver {g['allocs_calling_driver']} of {g['allocs']}; "
                f"a garbage collection ran in {g['allocs_with_gc']} (their max {_us(g['max_with_gc_s'])})"
            )
    finally:
        backend.close()
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvledger bench alloc", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
