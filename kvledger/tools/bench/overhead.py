"""The allocation-path cost of accounting plus publishing (part of `kvledger bench scrape`).

Three SWA pools of the DeepSeek-V4 geometry (43 layers, 584-byte tokens, 256 per
padded row, 2 MiB pages) on the host backend, every page mapped beforehand, so
only the hot path runs:

- `bare`: no observer;
- `control`: no observer either, a second pool measured exactly like `bare`: how
  far apart two identical pools read on this machine (the noise floor of the
  comparison);
- `accounted`: its ledger `Account` as observer, and a `Publisher` snapshotting
  that ledger every `publish_interval` for the whole run (it publishes from the
  accounted pool's safe points, so its work lands in the accounted pool's time).

Decode-like steps (alloc `batch` slots, free the previous batch) run in blocks of
about `block_ms`; the three pools take turns block by block, in rotating order,
for `seconds` of measured time each, so that the machine's drift and noise fall
on all three alike. Overhead = total time per step with / without - 1, in wall
clock and in process CPU (which includes the publisher's thread).
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from typing import Any

from accounting.ledger import Ledger
from accounting.snapfile.writer import Publisher
from allocator import HostBackend, SlotLayout, SwaPool
from allocator.specs import vmm_layer_specs
from kvledger.engines.sglang.dsv4 import Knobs, load_config, plan

POOLS = ("bare", "control", "accounted")


def swa_layout(full_tokens: int) -> tuple[int, SlotLayout]:
    """DeepSeek-V4-Flash's SWA layers and slot layout for a pool of `full_tokens`."""
    from kvledger.demo.source import default_config_path

    bm = plan(load_config(default_config_path()), Knobs(), full_tokens=full_tokens)
    first = bm.family_buffers("swa_kv")[0]
    layers = len(bm.family_buffers("swa_kv"))
    return layers, SlotLayout(
        capacity_slots=first.capacity_slots,
        slot_bytes=first.slot_bytes,
        page_bytes=2 << 20,
        slots_per_row=first.slots_per_row,
        row_bytes=first.row_bytes,
    )


def bench_overhead(
    *, batch: int, seconds: float, publish_interval: float, block_ms: float = 5.0
) -> dict[str, Any]:
    for name, value in (
        ("seconds", seconds),
        ("publish_interval", publish_interval),
        ("block_ms", block_ms),
    ):
        if not value > 0:
            raise ValueError(f"bench_overhead: {name}={value!r}, expected > 0")
    # Enough room for two batches on a few pages: 3 pages of 2 MiB per layer.
    layers, full = swa_layout(1 << 18)
    layout = SlotLayout(
        capacity_slots=min(
            full.capacity_slots, 3 * (2 << 20) // full.row_bytes * full.slots_per_row
        ),
        slot_bytes=full.slot_bytes,
        page_bytes=full.page_bytes,
        slots_per_row=full.slots_per_row,
        row_bytes=full.row_bytes,
    )
    if not 1 <= batch <= (layout.capacity_slots - 1) // 2:
        raise ValueError(
            f"bench_overhead: batch={batch!r}, expected 1 <= batch <= "
            f"{(layout.capacity_slots - 1) // 2} (two batches in the pool)"
        )
    with contextlib.ExitStack() as stack:
        directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvledger-bench-"))
        backend = stack.enter_context(HostBackend())
        ledger = Ledger({"model_name": "bench", "tp_rank": "0"})
        account = ledger.add_account(
            vmm_layer_specs(layout, layers, null_slot=False),
            page_bytes=layout.page_bytes,
            capacity_slots=layout.capacity_slots - 1,
        )
        pools = {
            name: stack.enter_context(
                SwaPool(
                    backend,
                    layers=layers,
                    layout=layout,
                    max_spare_pages=layout.num_pages,  # every page stays mapped
                    observer=account if name == "accounted" else None,
                    name=name,
                )
            )
            for name in POOLS
        }
        for pool in pools.values():  # map every page once, off the clock
            pool.free(pool.alloc(pool.capacity_slots))
        publisher = stack.enter_context(
            Publisher(ledger, directory, interval=publish_interval, source="bench")
        )
        held = {name: pool.alloc(batch) for name, pool in pools.items()}

        def block(name: str, steps: int) -> tuple[float, float]:
            pool, h = pools[name], held[name]
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(steps):
                nxt = pool.alloc(batch)
                pool.free(h)
                h = nxt
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            held[name] = h
            return dt, dc

        # Steps per block: about `block_ms` on the bare pool (timed after a warm-up).
        block("bare", 200)
        probe, _ = block("bare", 200)
        steps = max(1, round(block_ms / 1000 / (probe / 200)))
        for name in POOLS:  # warm-up
            block(name, steps)

        wall = dict.fromkeys(POOLS, 0.0)
        cpu = dict.fromkeys(POOLS, 0.0)
        done = dict.fromkeys(POOLS, 0)
        per_block: dict[str, list[float]] = {name: [] for name in POOLS}
        sequence0 = publisher.sequence
        cycle = 0
        while min(wall.values()) < seconds:
            k = cycle % len(POOLS)
            for name in POOLS[k:] + POOLS[:k]:
                dt, dc = block(name, steps)
                wall[name] += dt
                cpu[name] += dc
                done[name] += steps
                per_block[name].append(dt / steps)
            cycle += 1
        published = publisher.sequence - sequence0
        for name, pool in pools.items():
            pool.free(held[name])

    def per_step(figure: dict[str, float], name: str) -> float:
        return figure[name] / done[name]

    def pct(figure: dict[str, float], name: str) -> float:
        return (per_step(figure, name) / per_step(figure, "bare") - 1) * 100

    return {
        "layers": layers,
        "batch": batch,
        "steps_per_block": steps,
        "blocks_per_pool": cycle,
        "seconds_per_pool": seconds,
        "publish_interval_s": publish_interval,
        "snapshots_published": published,
        **{f"{name}_step_us": per_step(wall, name) * 1e6 for name in POOLS},
        **{f"{name}_cpu_step_us": per_step(cpu, name) * 1e6 for name in POOLS},
        **{f"{name}_block_median_us": statistics.median(per_block[name]) * 1e6 for name in POOLS},
        "overhead_pct": pct(wall, "accounted"),
        "cpu_overhead_pct": pct(cpu, "accounted"),
        "control_pct": pct(wall, "control"),
        "control_cpu_pct": pct(cpu, "control"),
    }


def report(over: dict[str, Any]) -> list[str]:
    """The lines `kvledger bench scrape` prints for one batch size."""
    met = "met" if over["overhead_pct"] <= 2 else "NOT met"
    return [
        f"alloc path: {over['layers']} layers, decode steps of {over['batch']} slots (alloc + "
        f"free), blocks of {over['steps_per_block']} steps, {over['blocks_per_pool']} blocks "
        f"(~{over['seconds_per_pool']:g} s) per pool, publisher every "
        f"{over['publish_interval_s']:g} s ({over['snapshots_published']} snapshots)",
        f"  wall us/step: no observer {over['bare_step_us']:8.3f}   second no-observer pool "
        f"{over['control_step_us']:8.3f} ({over['control_pct']:+.2f}%, the noise floor)   "
        f"accounting + publishing {over['accounted_step_us']:8.3f} "
        f"({over['overhead_pct']:+.2f}%)",
        f"  cpu  us/step: no observer {over['bare_cpu_step_us']:8.3f}   second no-observer pool "
        f"{over['control_cpu_step_us']:8.3f} ({over['control_cpu_pct']:+.2f}%)   "
        f"accounting + publishing {over['accounted_cpu_step_us']:8.3f} "
        f"({over['cpu_overhead_pct']:+.2f}%)   target <= 2%: {met}",
    ]
