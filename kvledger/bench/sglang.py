"""`kvledger bench sglang`: SGLang's own DeepSeek-V4 allocator, native and bridged, side by side.

Three SGLang 0.5.23 engines (`kvledger.bench.sglang_engine`: SGLang's pool,
request pool and SWA allocator, driven with the calls its scheduler makes) in one
process, on one device: `native` as SGLang ships it; `control`, a second native
engine measured exactly like the first (how far apart two identical engines read
on this machine: the resolution of every ratio); and `bridged`, attached with
`kvledger.sglang.bridge.attach` (host VMM backend on CPU, CUDA VMM backend on
CUDA) with a ledger and a `Publisher` snapshotting it every second. All run the
same workload; timed cases take turns round by round, the order rotating. The decode
step's, the round trip's and the fill/drain cycle's targets are judged on the ratio
paired by round (in each round, the ratio of the two engines' medians, which cancels what
drifts between rounds; the median of those ratios), printed under the ratio of the
overall medians.

Workload (`--requests` running requests of `--prompt` tokens, each decoding
`--decode-tokens` then finishing; page 256, window 128):

- decode step: SWA window eviction of every running request that is due (one
  free group) + one decode token per request + one finish + one admission;
  the requests are staggered, so one finishes every step;
- 4096-token round trip: admit a 4096-token request and finish it, on top of
  the running batch;
- fill/drain cycle: from empty, admit `--requests` requests one by one (each
  one's out-of-window prompt pages freed right after its prefill), then finish
  them all;
- churn: random admissions (1..4096-token prompts) and finishes of random
  requests, SWA occupancy sweeping between 10% and 90% (`sglang_cases.Churn`);
  after each event the bridged engine takes one step of the production compaction
  policy (`kvledger.sglang.bridge.compact_policy`, the plugin's; between batches, timed
  with the event); after every event past the warm-up, the bridge's mapped
  page ids are checked against ceil(held rows / rows per VMM page) + max spare
  pages + 1, and the swa_kv family's physical bytes are held against the occupied
  and the native bytes (`kvledger.bench.sglang_memory`: mean and max).

Maps are page ids (one VMM page in every layer), from the `swa_kv` account of the
bridge's ledger. The fewest maps a fill/drain cycle can make: every VMM page that
a row SGLang held during the cycle touches must be mapped at some point, unless
it was mapped when the cycle began, so fewest = |pages touched by those rows and
row 0| - page ids mapped at the start (a lower bound for the rows SGLang chose).

Allocations that waited on a driver call are read from `Bridge.stats()`
(`waited_allocs`) when the bridge counts them; otherwise "n/a".
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import warnings
from typing import Any

from kvledger.bench import sglang_cases as cases
from kvledger.bench.sglang_memory import report_line as memory_line

COUNTER_DRIVER_WAITS = cases.COUNTER_DRIVER_WAITS
TARGETS = {"decode_step": 1.03, "round_trip_4096": 1.05, "fill_drain": 1.3}
MAPS_SLACK = 1.10


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--requests", type=_positive, default=256, help="running requests (256)")
    p.add_argument("--prompt", type=_positive, default=1000, help="prompt tokens (1000)")
    p.add_argument("--decode-tokens", type=_positive, default=256, help="decode tokens (256)")
    p.add_argument("--layers", type=_positive, default=4, help="DeepSeek-V4 layers (4)")
    p.add_argument("--swa-pages", type=_positive, default=1024, help="SGLang SWA pages (1024)")
    p.add_argument("--rounds", type=_positive, default=20, help="rounds per timed case (20)")
    p.add_argument("--steps", type=_positive, default=25, help="decode steps per round (25)")
    p.add_argument("--trips", type=_positive, default=10, help="4096 round trips per round")
    p.add_argument("--cycles", type=_positive, default=8, help="fill/drain cycles (8)")
    p.add_argument("--churn-events", type=_positive, default=2000, help="churn events (2000)")
    p.add_argument("--churn-warmup", type=int, default=200, help="churn events not checked")
    p.add_argument(
        "--max-spare-pages",
        type=int,
        default=None,
        help="passed to the bridge (default: the bridge's own, "
        "kvledger.sglang.bridge.bridge.DEFAULT_POOL_OPTIONS)",
    )
    p.add_argument("--seed", type=int, default=13)
    p.add_argument(
        "--threads",
        type=_positive,
        default=None,
        help="torch intra-op threads (default: 1 on machines of <= 4 CPUs, else torch's own)",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON too")


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return v


def _sglang_missing() -> str | None:
    # SGLang's quantization modules warn at import that they need a GPU; not our business.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"sglang\.")
    try:
        import sglang  # noqa: F401
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import (  # noqa: F401
            DeepSeekV4TokenToKVPool,
        )
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return None


def run(args: argparse.Namespace) -> int:
    missing = _sglang_missing()
    if missing is not None:
        print(
            f"kvledger bench sglang: needs SGLang 0.5.23 importable (e.g. .venv-sglang); {missing}",
            file=sys.stderr,
        )
        return 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "kvledger bench sglang: --device cuda, but torch sees no CUDA device", file=sys.stderr
        )
        return 2
    threads = args.threads or (1 if (os.cpu_count() or 1) <= 4 else None)
    if threads is not None:
        torch.set_num_threads(threads)
    if args.churn_warmup < 0 or args.churn_warmup >= args.churn_events:
        print(
            f"kvledger bench sglang: --churn-warmup={args.churn_warmup}, expected "
            f"0..{args.churn_events - 1}",
            file=sys.stderr,
        )
        return 2
    if args.max_spare_pages is not None and args.max_spare_pages < 0:
        print(
            f"kvledger bench sglang: --max-spare-pages={args.max_spare_pages}, expected >= 0",
            file=sys.stderr,
        )
        return 2
    results = cases.run_all(args, threads=torch.get_num_threads())
    for line in report(results):
        print(line)
    if args.json:
        print(json.dumps(results, indent=2))
    gc.collect()
    return 0


# -- report ------------------------------------------------------------------------------------
def _ms(s: dict[str, float]) -> str:
    return (
        f"median {s['median'] * 1e3:8.3f} ms  min {s['min'] * 1e3:8.3f}  "
        f"max {s['max'] * 1e3:8.3f}  mean {s['mean'] * 1e3:8.3f}  n={s['n']}"
    )


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def report(r: dict[str, Any]) -> list[str]:
    c = r["config"]
    out = [
        f"bench sglang: SGLang {c['sglang']}, torch {c['torch']} ({c['threads']} intra-op "
        f"threads), device {c['device']}, backend {c['backend']} (granularity "
        f"{c['granularity']} bytes, {c['rows_per_vmm_page']:.3f} SWA rows per VMM page)",
        f"  {c['requests']} requests x {c['prompt']}-token prompts, {c['decode_tokens']} decode "
        f"tokens; page {c['page']}, window {c['window']}; {c['layers']} layers, "
        f"{c['swa_pages']} SWA pages; bridge: ledger + publisher (1 s), max_spare_pages "
        f"{c['max_spare_pages']}",
    ]
    targets = []
    for key, title in (
        ("decode_step", "decode step"),
        ("round_trip_4096", "4096-token alloc+release"),
        ("fill_drain", "fill/drain cycle"),
        ("churn_event", "churn event"),
    ):
        case = r[key]
        ratio = case["bridged"]["median"] / case["native"]["median"]
        floor = case["control"]["median"] / case["native"]["median"]
        case["ratio"], case["control_ratio"] = ratio, floor
        out.append(f"  {title}:")
        for name in ("native", "control", "bridged"):
            out.append(f"    {name:8s} {_ms(case[name])}")
        extra = ""
        if "bridged_maps" in case:
            extra = f"  (bridged maps {case['bridged_maps']}, unmaps {case['bridged_unmaps']})"
        means = case["bridged"]["mean"] / case["native"]["mean"]
        out.append(
            f"    ratio    {ratio:.3f}x bridged/native, {floor:.3f}x control/native (the "
            f"resolution){extra}; of the means {means:.3f}x"
        )
        pr = case.get("paired")
        if pr is not None:  # the target is judged on the ratio paired by round
            b, k = pr["bridged"], pr["control"]
            out.append(
                f"    paired by round ({pr['rounds']} rounds): bridged/native median "
                f"{b['median']:.3f}x (min {b['min']:.3f} max {b['max']:.3f}), control/native "
                f"median {k['median']:.3f}x (min {k['min']:.3f} max {k['max']:.3f})"
            )
            ratio = b["median"]
        limit = TARGETS.get(key)
        if limit is None:
            continue
        if key == "fill_drain" and c["device"] != "cpu":
            targets.append(
                f"  target fill/drain <= {limit}x: host backend only (ratio {ratio:.3f}x)"
            )
            continue
        how = ", paired by round" if pr is not None else ""
        targets.append(
            f"  target {title} <= {limit}x native: {_met(ratio <= limit)} ({ratio:.3f}x{how})"
        )
    fd = r["fill_drain"]
    out.append(
        "  maps per fill/drain cycle (page ids mapped; fewest possible = VMM pages touched by "
        "the SWA rows SGLang held during the cycle, row 0 included, less the page ids already "
        "mapped when it began; packed = ceil(peak rows held at once / rows per VMM page) "
        "less those mapped):"
    )
    for i, cy in enumerate(fd["cycles"]):
        out.append(
            f"    cycle {i}: maps {cy['maps']:4d}  unmaps {cy['unmaps']:4d}  fewest {cy['fewest']:4d}"
            f"  packed {cy['packed']:4d}  ({cy['maps'] / max(cy['fewest'], 1):.2f}x fewest)"
        )
    worst = max(cy["maps"] / max(cy["fewest"], 1) for cy in fd["cycles"])
    maps_ok = all(cy["maps"] <= MAPS_SLACK * cy["fewest"] for cy in fd["cycles"])
    targets.append(
        f"  target maps per cycle <= {MAPS_SLACK:.2f}x fewest, every cycle: {_met(maps_ok)} "
        f"(worst {worst:.2f}x)"
    )
    ch = r["churn"]
    out.append(
        f"  churn: {ch['events']} events ({ch['admits']} admissions, {ch['finishes']} finishes), "
        f"occupancy {ch['occupancy_min']:.0%}..{ch['occupancy_max']:.0%}; bound = ceil(held rows "
        f"/ rows per VMM page) + max spare pages ({c['max_spare_pages']}) + 1, held rows with "
        f"row 0; checked after event {ch['warmup']}; after every event the bridge takes a step "
        f"of the production compaction policy ({ch['rows_moved']} rows moved)"
    )
    out.append(memory_line(ch["swa_memory"], ch["compaction"]))
    out.append(
        f"    mapped page ids - bound: max {ch['excess_max']:+d}, samples over {ch['over']} of "
        f"{ch['checked']}; mapped max {ch['mapped_max']}, bound at that sample {ch['bound_at_max']}"
    )
    out.append(
        f"    of which: spare page ids at most {ch['spares_max']} (max spare pages + 1 = "
        f"{c['max_spare_pages'] + 1}); page ids in use beyond ceil(held rows / rows per VMM "
        f"page) at most {ch['in_use_excess_max']:+d}"
    )
    targets.append(f"  target churn mapped <= bound at every sample: {_met(ch['over'] == 0)}")
    waits = r["driver_waits"]
    if waits is None:
        line = (
            f"  allocations that waited on a driver call: n/a (Bridge.stats() has no "
            f"{COUNTER_DRIVER_WAITS!r} counter yet)"
        )
        if c["device"] == "cuda":
            targets.append("  target no allocation waits on a driver call (CUDA): n/a, not counted")
    else:
        line = f"  allocations that waited on a driver call ({COUNTER_DRIVER_WAITS}): {waits}"
        by_case = r.get("driver_waits_by_case") or {}
        if by_case:
            line += " (" + ", ".join(f"{k} {n}" for k, n in by_case.items()) + ")"
        if c["device"] == "cuda":
            targets.append(f"  target no allocation waits on a driver call: {_met(waits == 0)}")
    out.append(line)
    out.append("targets:")
    out.extend(targets)
    return out
