"""`kvledger bench sglang --part serving`: SGLang's own DeepSeek-V4 allocator, native and bridged,
inside an overlap-scheduled serving loop with a forward stand-in on the device.

The parts: the loop, SGLang 0.5.23's `Scheduler.event_loop_overlap` cut down to what the KV
pool sees (`sglang_loop`); the forward stand-ins, `torch.cuda._sleep` on a stream of its own
on CUDA, a worker thread on the host (`sglang_forward`); the waits on the scheduler thread,
counted and timed (`sglang_waits`); the request trace, `lognormal-chat` (`sglang_trace`); the
no-synchronisation proof (`sglang_proof`, `python -m kvledger.tools.bench.sglang_serving
proof`). This module runs the rounds and reports.

Measured per step: the scheduler thread's host work (prepare + process, the loop's wait
excluded), the waits inside it and the time they blocked: on CUDA each synchronisation
torch's sync debug mode reports (`warn`) plus every `torch.cuda.Event.synchronize` /
`torch.cuda.synchronize` call (wrapped and timed; an implicit synchronisation, e.g. a copy
to the host, is counted and charged the whole phase it happened in: an upper bound); on the
host the waits `ModelReader` counted and timed (exact). Rounds of `--serving-steps` steps,
native and bridged interleaved (the order alternating); steps/s and tokens/s paired by
round (`bootstrap`, median and 95 % interval). Compactions (policy steps that moved rows)
and waits per 1,000 steps; the swa_kv family's physical bytes after every step against the
native pool's (`sglang_memory.SwaMemory`), and the mapped page ids against the packing
bound (+ the policy's slack).
"""

from __future__ import annotations

import contextlib
import statistics
import threading
from collections.abc import Callable
from typing import Any

from kvledger.engines.sglang.bridge.compact_policy import CompactionPolicy
from kvledger.gc_clock import GcClock
from kvledger.tools.bench import bootstrap
from kvledger.tools.bench.sglang_engine import (
    PAGE,
    WINDOW,
    Shape,
    attach_bridge,
    published,
    swa_vmm_account,
)
from kvledger.tools.bench.sglang_forward import CudaDevice, HostDevice
from kvledger.tools.bench.sglang_loop import ServingEngine, ServingLoop
from kvledger.tools.bench.sglang_memory import SwaMemory
from kvledger.tools.bench.sglang_proof import main  # the entry: `python -m` this module
from kvledger.tools.bench.sglang_trace import TraceSpec, make_trace, prefix_tokens
from kvledger.tools.bench.sglang_waits import CudaSyncWatch, WaitLog, model_reader

# The forward times the GPU run spans (ms): see docs/benchmarks.md, "serving loop".
FORWARD_MS = (5.0, 15.0, 40.0)


def _parse_list(text: str, kind: Callable[[str], Any]) -> list[Any]:
    return [kind(x) for x in text.split(",") if x.strip()]


def compaction_settings(text: str) -> list[tuple[str, CompactionPolicy]]:
    """`off,0,1,2,4` -> policies (off: KVLEDGER_SGLANG_DSV4_COMPACT=0; N: slack N)."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if item == "off":
            out.append(("off", CompactionPolicy(enabled=False)))
        elif item == "env":
            out.append(("env", CompactionPolicy.from_env()))
        else:
            out.append((f"slack {int(item)}", CompactionPolicy(excess_pages=int(item))))
    return out


def trace_spec(args: Any) -> TraceSpec:
    """The trace of `--serving-rounds` x `--serving-steps` steps the arguments ask for."""
    return TraceSpec(
        steps=args.serving_rounds * args.serving_steps,
        rate=args.serving_rate,
        prompt_median=args.serving_prompt_median,
        output_median=args.serving_output_median,
        prompt_max=args.serving_prompt_max,
        output_max=args.serving_output_max,
        seed=args.seed,
    )


def shape_of(args: Any, spec: TraceSpec) -> Shape:
    max_tokens = spec.prompt_max + prefix_tokens(spec, spec.prefix_groups - 1) + spec.output_max
    max_context = -(-max_tokens // PAGE) * PAGE + PAGE
    return Shape(
        layers=args.layers,
        swa_pages=args.serving_swa_pages,
        full_pages=args.serving_full_pages,
        requests=args.serving_max_running + spec.prefix_groups + 2,
        max_context=max_context,
    )


def _summary(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    n = len(s)
    return {
        "median": statistics.median(s),
        "mean": statistics.fmean(s),
        "p99": s[min(n - 1, int(0.99 * n))],
        "max": s[-1],
        "n": n,
    }


def _paired(num: list[float], den: list[float]) -> dict[str, Any]:
    r = bootstrap.ratios(num, den)
    return {**bootstrap.median_ci(r).as_dict(), "min": min(r), "max": max(r)}


def run_one(
    args: Any,
    forward_ms: float,
    label: str,
    policy: CompactionPolicy,
    log_progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Native and bridged through the same trace at one forward time and one compaction
    setting, in interleaved rounds."""
    import torch

    from accounting.ledger import Ledger
    from kvledger.tools.bench.sglang_cases import churn_bound

    rounds, per_round = args.serving_rounds, args.serving_steps
    spec = trace_spec(args)
    trace = make_trace(spec)
    shape = shape_of(args, spec)
    cuda = args.device == "cuda"
    dev_name = "cuda:0" if cuda else "cpu"
    with published(), contextlib.ExitStack() as stack:
        device: Any = CudaDevice(dev_name) if cuda else HostDevice()
        stack.callback(device.close)
        if cuda:
            stack.enter_context(torch.cuda.stream(device.sched))
        native_e = ServingEngine(shape, dev_name)
        bridged_e = ServingEngine(shape, dev_name)
        control = bool(getattr(args, "serving_control", False))
        ledger = Ledger({"model_name": "kvledger-bench-sglang-serving"})
        pool_options: dict[str, Any] = (
            {} if args.max_spare_pages is None else {"max_spare_pages": args.max_spare_pages}
        )
        if getattr(args, "serving_cold_compaction", False):
            pool_options["warm_compaction"] = False
        bridge: Any = attach_bridge(bridged_e, ledger, pool_options)
        stack.callback(bridge.detach)
        logs = {"native": WaitLog(), "bridged": WaitLog(), "control": WaitLog()}
        for lg in logs.values():
            lg.owner = threading.get_ident()
        if not cuda:
            model_reader(bridge, device, logs["bridged"])
        watch = CudaSyncWatch(logs["native"]) if cuda else None
        fwd = forward_ms / 1000
        clock = stack.enter_context(GcClock())  # collections timed per step, every variant
        loops = {
            "native": ServingLoop(
                "native", native_e, trace, spec, device, fwd,
                max_running=args.serving_max_running, prefill_tokens=args.serving_prefill_tokens,
                watch=watch, log=logs["native"], gc_clock=clock,
            ),
            "bridged": ServingLoop(
                "bridged", bridged_e, trace, spec, device, fwd,
                max_running=args.serving_max_running, prefill_tokens=args.serving_prefill_tokens,
                policy=policy, compact_at=args.serving_compact, watch=watch,
                log=logs["bridged"], bridge=bridge, gc_clock=clock,
            ),
        }  # fmt: skip
        if control:  # native again: its ratio to native is the loop's own spread
            loops["control"] = ServingLoop(
                "control", ServingEngine(shape, dev_name), trace, spec, device, fwd,
                max_running=args.serving_max_running, prefill_tokens=args.serving_prefill_tokens,
                watch=watch, log=logs["control"], gc_clock=clock,
            )  # fmt: skip
        for lp in loops.values():
            lp.hold_prefixes()
        bridge.wait_idle()
        account = swa_vmm_account(ledger)
        row_bytes = int(bridged_e.pool.swa_kv_pool.kv_buffer[0].shape[1])
        gran = int(bridge.backend.granularity)
        memory = SwaMemory(row_bytes=row_bytes, layers=args.layers, rows=shape.swa_pages)
        slack = policy.excess_pages if policy.enabled else 0
        over = {"bound": 0, "bound_slack": 0, "samples": 0}
        mapped_max = [0]

        def sample() -> None:
            held = bridged_e.held_swa_pages()
            st = bridge.store.stats()
            mapped, physical = int(st["mapped_pages"]), int(st["physical_bytes"])
            memory.add(physical, held)
            bound = churn_bound(held, (row_bytes, gran), int(bridge.store.policy.max_spare_pages))
            over["samples"] += 1
            over["bound"] += mapped > bound
            over["bound_slack"] += mapped > bound + slack
            mapped_max[0] = max(mapped_max[0], mapped)

        def noop() -> None:
            bridged_e.held_swa_pages()  # the same bookkeeping on native, minus the bridge's

        m0, u0 = account.pages_mapped_total, account.pages_unmapped_total
        order = ("native", "bridged", "control") if control else ("native", "bridged")
        times: dict[str, list[float]] = {k: [] for k in order}
        toks: dict[str, list[int]] = {k: [] for k in order}
        warmup = int(getattr(args, "serving_warmup_steps", 0) or 0)
        warm_max: dict[str, float] = {}
        with watch.installed() if watch is not None else contextlib.nullcontext():
            if warmup:  # untimed, every variant alike, as an engine warms up before serving
                for k in order:
                    if watch is not None:
                        watch.log = logs[k]
                    loops[k].run(warmup)
                    warm_max[k] = max(loops[k].times.host, default=0.0) * 1e3
                    loops[k].forget_times()
                    if k == "bridged":
                        bridge.wait_idle()
            for i in range(rounds):
                # each variant first in turn: no variant always runs after the same one
                for k in order[i % len(order) :] + order[: i % len(order)]:
                    if watch is not None:
                        watch.log = logs[k]
                    seconds, tokens = loops[k].run(per_round, sample if k == "bridged" else noop)
                    times[k].append(seconds)
                    toks[k].append(tokens)
                    if k == "bridged":
                        bridge.wait_idle()
        m1, u1 = account.pages_mapped_total, account.pages_unmapped_total
        stats = bridge.stats()
        out: dict[str, Any] = {
            "forward_ms": forward_ms,
            "compaction": label,
            "policy": policy.describe(),
            "rounds": rounds,
            "steps_per_round": per_round,
            "same_tokens": toks["native"] == toks["bridged"]
            and loops["native"].digest.hexdigest() == loops["bridged"].digest.hexdigest(),
            "tokens": sum(toks["native"]),
            "requests_finished": loops["native"].finished,
            "requests_in_trace": len(trace),
            "idle_steps": loops["native"].idle_steps,
            "warmup_steps": warmup,
            "compaction_warmed": bool(bridge.compaction_warmed),
        }
        steps_total = rounds * per_round
        for k in order:
            lp = loops[k]
            tm = lp.times
            out[k] = {
                "round_s": _summary(times[k]),
                "steps_per_s": statistics.median(per_round / t for t in times[k]),
                "tokens_per_s": statistics.median(
                    n / t for n, t in zip(toks[k], times[k], strict=True)
                ),
                "host_us": {a: b * 1e6 if a != "n" else b for a, b in _summary(tm.host).items()},
                "blocked_us": {
                    a: b * 1e6 if a != "n" else b for a, b in _summary(tm.blocked).items()
                },
                "loop_wait_ms": statistics.median(tm.loop_wait) * 1e3,
                "waits_per_1000_steps": 1000 * sum(tm.waits) / steps_total,
                "wait_kinds": dict(logs[k].kinds),
                "other_thread_waits": logs[k].other_waits,
                "slowest_steps": tm.slowest(3),
                "gc_ms_total": sum(tm.gc) * 1e3,
                "warmup_host_max_ms": warm_max.get(k),
            }
        b = loops["bridged"]
        out["paired"] = {
            "tokens_per_s": _paired(
                [t / s for t, s in zip(toks["bridged"], times["bridged"], strict=True)],
                [t / s for t, s in zip(toks["native"], times["native"], strict=True)],
            ),
            "steps_per_s": _paired(times["native"], times["bridged"]),
        }
        if control:
            out["paired"]["control_tokens_per_s"] = _paired(
                [t / s for t, s in zip(toks["control"], times["control"], strict=True)],
                [t / s for t, s in zip(toks["native"], times["native"], strict=True)],
            )
            out["same_tokens"] = out["same_tokens"] and toks["control"] == toks["native"]
        out["blocked_added_us_median"] = (
            out["bridged"]["blocked_us"]["median"] - out["native"]["blocked_us"]["median"]
        )
        out["bridged"].update(
            compactions_per_1000_steps=1000 * b.compactions / steps_total,
            rows_moved=b.rows_moved,
            policy_stats=policy.stats(),
            maps=m1 - m0,
            unmaps=u1 - u0,
            waited_allocs=int(stats.get("waited_allocs", 0)),
            forced_replays=int(stats.get("forced_replays", 0)),
            readback_waits=int(stats.get("readback_waits", 0)),
        )
        out["swa_memory"] = memory.result()
        out["bound"] = {**over, "slack": slack, "mapped_max": mapped_max[0]}
        for lp in loops.values():
            lp.finish_all()
        if log_progress is not None:
            ci = out["paired"]["tokens_per_s"]
            log_progress(
                f"bench sglang serving: forward {forward_ms:g} ms, compaction {label}: "
                f"bridged/native tokens/s {ci['median']:.4f}x [{ci['low']:.4f}, {ci['high']:.4f}]"
            )
        return out


def run_serving(args: Any, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every forward time at the first compaction setting, and every compaction setting at
    `--serving-curve-ms` (the curve)."""
    import importlib.metadata

    import torch

    forwards = _parse_list(args.serving_forward_ms, float)
    settings = compaction_settings(args.serving_compaction)
    runs: list[dict[str, Any]] = []
    plan: list[tuple[float, str, CompactionPolicy]] = []
    first_label, first_policy = settings[0]
    for f in forwards:
        plan.append((f, first_label, first_policy))
    curve_ms = args.serving_curve_ms if args.serving_curve_ms is not None else forwards[0]
    for label, policy in settings[1:]:
        plan.append((curve_ms, label, policy))
    if curve_ms not in forwards and settings:
        plan.append((curve_ms, first_label, first_policy))
    for f, label, policy in plan:
        fresh = CompactionPolicy(
            excess_pages=policy.excess_pages, max_moves=policy.max_moves, enabled=policy.enabled
        )
        runs.append(run_one(args, f, label, fresh, progress))
    return {
        "config": {
            "sglang": importlib.metadata.version("sglang"),
            "torch": torch.__version__,
            "device": args.device,
            "trace": trace_spec(args).describe(),
            "layers": args.layers,
            "swa_pages": args.serving_swa_pages,
            "max_running": args.serving_max_running,
            "prefill_tokens": args.serving_prefill_tokens,
            "rounds": args.serving_rounds,
            "steps_per_round": args.serving_steps,
            "compact_at": args.serving_compact,
            "control": bool(getattr(args, "serving_control", False)),
            "curve_ms": curve_ms,
            "window": WINDOW,
            "page": PAGE,
        },
        "runs": runs,
    }


def report(r: dict[str, Any]) -> list[str]:
    c = r["config"]
    out = [
        f"bench sglang serving: SGLang {c['sglang']}, torch {c['torch']}, device {c['device']}; "
        f"{c['layers']} layers, {c['swa_pages']} SWA pages, at most {c['max_running']} running, "
        f"{c['prefill_tokens']} prefill tokens a step; compaction at: {c['compact_at']}",
        f"  trace {c['trace']}",
        f"  {c['rounds']} rounds of {c['steps_per_round']} steps a variant, native and bridged "
        f"interleaved; ratios paired by round, median [95% bootstrap interval]",
    ]
    for run in r["runs"]:
        p = run["paired"]
        t, s = p["tokens_per_s"], p["steps_per_s"]
        nat, br = run["native"], run["bridged"]
        out.append(
            f"  forward {run['forward_ms']:g} ms, compaction {run['compaction']}: "
            f"{run['tokens']} tokens, {run['requests_finished']}/{run['requests_in_trace']} "
            f"requests finished; same tokens native/bridged: {run['same_tokens']}; "
            f"compaction kernels warmed at attach: {run.get('compaction_warmed')}"
        )
        out.append(
            f"    tokens/s bridged/native {t['median']:.4f}x [{t['low']:.4f}, {t['high']:.4f}]; "
            f"steps/s {s['median']:.4f}x [{s['low']:.4f}, {s['high']:.4f}]; native "
            f"{nat['tokens_per_s']:.0f} tokens/s, {nat['steps_per_s']:.1f} steps/s"
        )
        if "control_tokens_per_s" in p:
            cc = p["control_tokens_per_s"]
            out.append(
                f"    control native/native tokens/s {cc['median']:.4f}x [{cc['low']:.4f}, "
                f"{cc['high']:.4f}] (min {cc['min']:.4f}, max {cc['max']:.4f}): the loop's own "
                "spread"
            )
        for k, v in (("native", nat), ("bridged", br)):
            out.append(
                f"    {k:8s} host work/step median {v['host_us']['median']:.0f} us, p99 "
                f"{v['host_us']['p99']:.0f}, max {v['host_us']['max']:.0f}; blocked on the device "
                f"median {v['blocked_us']['median']:.1f} us, mean {v['blocked_us']['mean']:.1f}, "
                f"max {v['blocked_us']['max']:.0f}; waits/1000 steps {v['waits_per_1000_steps']:.1f} "
                f"{v['wait_kinds'] or ''}; loop wait median {v['loop_wait_ms']:.2f} ms"
            )
        for k, v in (("native", nat), ("bridged", br)):
            slow = "; ".join(
                f"r{x['round']}s{x['step']} {x['host_ms']:.1f} ms (prepare {x['prepare_ms']:.1f}, "
                f"process {x['process_ms']:.1f}, gc {x['gc_ms']:.1f}, blocked "
                f"{x['blocked_ms']:.1f}{', compacted' if x['compacted'] else ''})"
                for x in v.get("slowest_steps", ())
            )
            warm = v.get("warmup_host_max_ms")
            out.append(
                f"    {k:8s} slowest steps: {slow}; gc in steps {v.get('gc_ms_total', 0):.1f} ms"
                + (f"; warm-up's slowest {warm:.1f} ms" if warm is not None else "")
            )
        m, b = run["swa_memory"], run["bound"]
        out.append(
            f"    bridged: compactions/1000 steps {br['compactions_per_1000_steps']:.1f} "
            f"({br['rows_moved']} rows moved), maps {br['maps']}, unmaps {br['unmaps']}, "
            f"waited allocs {br['waited_allocs']}, forced replays {br['forced_replays']}; "
            f"blocked added (median) {run['blocked_added_us_median']:+.1f} us/step"
        )
        if m["samples"]:
            out.append(
                f"    swa_kv physical / native: mean {m['physical_per_native']['mean']:.3f}x, "
                f"max {m['physical_per_native']['max']:.3f}x; physical / occupied mean "
                f"{m['physical_per_occupied']['mean']:.2f}x; mapped over the packing bound in "
                f"{b['bound']} of {b['samples']} samples (over bound + slack {b['slack']}: "
                f"{b['bound_slack']})"
            )
    return out


if __name__ == "__main__":
    raise SystemExit(main())
