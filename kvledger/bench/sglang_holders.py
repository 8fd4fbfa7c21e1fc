"""What reading the holders costs against a decode step, on SGLang 0.5.23's own objects.

    .venv-sglang/bin/python -m kvledger.bench.sglang_holders [--device cuda] [--rounds 9]

Builds SGLang's DeepSeek-V4 pool, request pool and SWA allocator (`kvledger.bench.
sglang_engine.Engine`) with a UnifiedRadixCache over them holding a shared prefix, admits
`requests` requests on it, and then, round by round, times `steps` decode steps of every
running request (SGLang's `alloc_decode`, the request-to-token writes, window eviction)
and `steps` reads of the holders (`HolderReader.read`, what each snapshot runs first),
interleaved so that what drifts between rounds hits both. Reported: the median, min and
max of each over the rounds (per step, per read), and the per-round ratio read / step,
its median, min and max and the number of rounds. The target is a ratio of at most 1 %
(a read runs once per publish, a step many times a second, so the share of the engine's
time is smaller still). torch is pinned to one intra-op thread.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

TARGET_RATIO = 0.01


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def holders_cost(
    *,
    layers: int = 8,
    requests: int = 16,
    rounds: int = 9,
    steps: int = 20,
    device: str = "cpu",
) -> dict[str, Any]:
    """Seconds per decode step and per holder read, and their per-round ratio."""
    import torch

    from accounting.ledger import Ledger
    from kvledger.bench.sglang_engine import PAGE, WINDOW, Engine, Shape, published
    from kvledger.sglang.holders import HolderReader, dsv4_units
    from kvledger.sglang.inventory import register_pool

    torch.set_num_threads(1)
    context = (rounds * steps // PAGE + 4) * PAGE
    with published():
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        shape = Shape(
            layers=layers,
            swa_pages=requests * 3 + 4,
            full_pages=requests * (context // PAGE) + 4,
            requests=requests,
            max_context=context,
        )
        e = Engine(shape, device)
        tree = UnifiedRadixCache(
            CacheInitParams(
                disable=False,
                req_to_token_pool=e.r2t,
                token_to_kv_pool_allocator=e.allocator,
                page_size=PAGE,
                sliding_window_size=WINDOW,
                tree_components=(ComponentType.FULL, ComponentType.SWA),
            )
        )
        ledger = Ledger({"model_name": "bench-holders"})
        inv = register_pool(ledger, e.pool, name="dsv4")
        reader = HolderReader(
            ledger,
            {a.family: a for a in inv.accounts},
            tree=tree,
            allocator=e.allocator,
            req_to_token=e.r2t,
            units=dsv4_units(e.pool),
            running=lambda: e.running,
        )
        core_ledger = Ledger({"model_name": "bench-holders-core"})
        core_inv = register_pool(core_ledger, e.pool, name="dsv4")
        core = HolderReader(  # the holders alone, without the per-request footprints
            core_ledger,
            {a.family: a for a in core_inv.accounts},
            tree=tree,
            allocator=e.allocator,
            req_to_token=e.r2t,
            units=dsv4_units(e.pool),
        )
        try:
            for _ in range(requests):
                e.prefill(PAGE + 16)
            step_s: list[float] = []
            read_s: list[float] = []
            core_s: list[float] = []
            ratios: list[float] = []
            core_ratios: list[float] = []
            for _ in range(rounds):
                e.sync()
                t0 = time.perf_counter()
                for _ in range(steps):
                    e.decode()
                    e.evict_windows()
                e.sync()
                step = (time.perf_counter() - t0) / steps
                t0 = time.perf_counter()
                for _ in range(steps):
                    reader.read()
                read = (time.perf_counter() - t0) / steps
                t0 = time.perf_counter()
                for _ in range(steps):
                    core.read()
                core_read = (time.perf_counter() - t0) / steps
                step_s.append(step)
                read_s.append(read)
                core_s.append(core_read)
                ratios.append(read / step)
                core_ratios.append(core_read / step)
            e.finish_all()
        finally:
            reader.close()
            core.close()
    return {
        "device": device,
        "layers": layers,
        "requests": requests,
        "steps_per_round": steps,
        "decode_step": _stats(step_s),
        "holder_read": _stats(read_s),
        "core_read": _stats(core_s),
        "ratio": _stats(ratios),
        "core_ratio": _stats(core_ratios),
    }


def report(r: dict[str, Any]) -> list[str]:
    def us(s: dict[str, float]) -> str:
        return (
            f"median {s['median'] * 1e6:9.1f} us  min {s['min'] * 1e6:9.1f}  "
            f"max {s['max'] * 1e6:9.1f}  ({s['n']} rounds)"
        )

    q, c = r["ratio"], r["core_ratio"]
    ok = q["median"] <= TARGET_RATIO
    per_s = r["holder_read"]["median"]  # one read per publish, 1 s apart by default
    return [
        f"holders read vs decode step ({r['device']}, {r['layers']} layers, "
        f"{r['requests']} running requests, {r['steps_per_round']} of each per round, "
        "interleaved, torch 1 thread)",
        f"  decode step  {us(r['decode_step'])}",
        f"  holder read  {us(r['holder_read'])}  (holders and per-request footprints)",
        f"  holders only {us(r['core_read'])}",
        f"  holders only / step  median {c['median'] * 100:.3f} %  min {c['min'] * 100:.3f} %  "
        f"max {c['max'] * 100:.3f} %",
        f"  read / step  median {q['median'] * 100:.3f} %  min {q['min'] * 100:.3f} %  "
        f"max {q['max'] * 100:.3f} %  ({q['n']} rounds)  target <= {TARGET_RATIO:.0%}: "
        + ("met" if ok else "NOT met"),
        f"  at one read per 1 s publish: {per_s * 100:.4f} % of the engine's time",
        "  (the step here is SGLang's allocator work of a decode step, no model forward: a "
        "real decode step is that plus the forward)",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args(argv)
    r = holders_cost(
        layers=a.layers, requests=a.requests, rounds=a.rounds, steps=a.steps, device=a.device
    )
    print("\n".join(report(r)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
