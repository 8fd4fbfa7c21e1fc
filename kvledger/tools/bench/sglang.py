"""`kvledger bench sglang`: SGLang's own DeepSeek-V4 allocator, native and bridged, side by side.

Three SGLang 0.5.23 engines (`kvledger.tools.bench.sglang_engine`: SGLang's pool,
request pool and SWA allocator, driven with the calls its scheduler makes) in one
process, on one device: `native` as SGLang ships it; `control`, a second native
engine measured exactly like the first (how far apart two identical engines read
on this machine: the resolution of every ratio); and `bridged`, attached with
`kvledger.engines.sglang.bridge.attach` (host VMM backend on CPU, CUDA VMM backend on
CUDA) with a ledger and a `Publisher` snapshotting it every second. All run the
same workload. torch is pinned to one intra-op thread (`--threads`).

How it is timed (`sglang_cases.run_rounds`): each case runs in rounds; in each round
each engine runs the case's whole round of work back to back, the order rotating, and a
round's time is all of it, every step and every journal replay its calls caused (the
bridged engine's journal is flushed inside its timed round); untimed between rounds, the
bridged engine's background mapper is let finish (so that its leftovers never run in
another engine's round). Each round gives one ratio per engine, its round time over
native's; a case reports the median of those ratios and its 95 % bootstrap interval over
rounds (`kvledger.tools.bench.bootstrap`: 4000 resamples, fixed seed 20261202). Rounds
continue past `--rounds` (`--cycles` for fill/drain, `--churn-events` for churn), in
steps of 10, until the bridged/native interval is within +-`--ci-width` (2 %) and lies
on one side of the case's target, or `--max-rounds` (`--max-cycles`) is reached; where it is not reached, the report says so
with the control/native interval beside it (the machine's own spread). A target ("at
most X native") is met only when the interval's upper end is under it, not met when its
lower end is at or above it, and not resolved otherwise.

Workload (`--requests` running requests of `--prompt` tokens, each decoding
`--decode-tokens` then finishing; page 256, window 128):

- decode step: SWA window eviction of every running request that is due (one
  free group) + one decode token per request + one finish + one admission;
  the requests are staggered, so one finishes every step; a round is `--steps` steps;
- 4096-token round trip: admit a 4096-token request and finish it, on top of
  the running batch; a round is `--trips` of them;
- fill/drain cycle: from empty, admit `--requests` requests one by one (each
  one's out-of-window prompt pages freed right after its prefill), then finish
  them all; a round is one cycle;
- churn: random admissions (1..4096-token prompts) and finishes of random
  requests, SWA occupancy sweeping between 10% and 90% (`sglang_cases.Churn`); a round
  is `--churn-round` events; after each event the bridged engine takes one step of the
  production compaction policy (`kvledger.engines.sglang.bridge.compact_policy`, the plugin's;
  `sglang_cases.compact_between_events`, the one call site, timed with the event); after
  every event past the warm-up, the bridge's mapped page ids are checked against
  ceil(held rows / rows per VMM page) + max spare pages + 1 (and, when
  `KVLEDGER_SGLANG_DSV4_COMPACT_SLACK` gives the policy a slack, against that + the slack
  too; `KVLEDGER_SGLANG_DSV4_COMPACT=0` turns compaction off), and the swa_kv family's
  physical bytes are held against the occupied and the native bytes
  (`kvledger.tools.bench.sglang_memory`: mean and max). Events follow each other back to
  back unless `--churn-gap-ms` asks for an untimed pause after each (on every engine),
  standing in for the forward a server runs between two scheduler steps: the background
  mapper then has time to map ahead, as it has in a server.

Maps are page ids (one VMM page in every layer), from the `swa_kv` account of the
bridge's ledger. The fewest maps a fill/drain cycle can make: every VMM page that
a row SGLang held during the cycle touches must be mapped at some point, unless
it was mapped when the cycle began, so fewest = |pages touched by those rows and
row 0| - page ids mapped at the start (a lower bound for the rows SGLang chose).

Allocations that waited on a driver call are read from `Bridge.stats()`
(`waited_allocs`) when the bridge counts them; otherwise "n/a".

`--part` picks what runs: `allocator` (the cases above), `holders` (what reading the
holders costs beside SGLang's allocator work of a decode step, one engine with a
UnifiedRadixCache: `kvledger.tools.bench.sglang_holders`, `--holders-requests` running
requests), `all` (both, the default) or `serving` (not in `all`): SGLang's overlap-scheduled
serving loop with a forward stand-in on the device, native and bridged, over a request
trace (`kvledger.tools.bench.sglang_serving`, whose docstring says what is measured).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import warnings
from typing import Any

from kvledger.argtypes import number
from kvledger.tools.bench import bootstrap
from kvledger.tools.bench import sglang_cases as cases
from kvledger.tools.bench import sglang_serving as serving
from kvledger.tools.bench.sglang_memory import report_line as memory_line

COUNTER_DRIVER_WAITS = cases.COUNTER_DRIVER_WAITS
TARGETS = cases.TARGETS
MAPS_SLACK = 1.10
CI_WIDTH = 0.02


PARTS = ("all", "allocator", "holders", "serving")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--part",
        choices=PARTS,
        default="all",
        help="allocator: the four native/control/bridged cases; holders: what reading the "
        "holders costs beside a decode step (kvledger.tools.bench.sglang_holders); all: both (all); "
        "serving: the overlap-scheduled serving loop (kvledger.tools.bench.sglang_serving; not in all)",
    )
    add_serving_arguments(p)
    p.add_argument(
        "--holders-requests", type=_positive, default=16, help="holders: running requests (16)"
    )
    p.add_argument("--holders-rounds", type=_positive, default=9, help="holders: rounds (9)")
    p.add_argument(
        "--holders-steps", type=_positive, default=20, help="holders: steps and reads per round"
    )
    p.add_argument("--requests", type=_positive, default=256, help="running requests (256)")
    p.add_argument("--prompt", type=_positive, default=1000, help="prompt tokens (1000)")
    p.add_argument("--decode-tokens", type=_positive, default=256, help="decode tokens (256)")
    p.add_argument("--layers", type=_positive, default=4, help="DeepSeek-V4 layers (4)")
    p.add_argument("--swa-pages", type=_positive, default=1024, help="SGLang SWA pages (1024)")
    p.add_argument(
        "--rounds", type=_positive, default=30, help="least rounds of decode and round trip (30)"
    )
    p.add_argument(
        "--max-rounds",
        type=_positive,
        default=300,
        help="most rounds of decode, round trip and churn (300)",
    )
    p.add_argument("--steps", type=_positive, default=25, help="decode steps per round (25)")
    p.add_argument("--trips", type=_positive, default=20, help="4096 round trips per round (20)")
    p.add_argument("--cycles", type=_positive, default=20, help="least fill/drain cycles (20)")
    p.add_argument("--max-cycles", type=_positive, default=120, help="most fill/drain cycles")
    p.add_argument("--churn-events", type=_positive, default=2000, help="least churn events")
    p.add_argument("--churn-round", type=_positive, default=50, help="churn events per round")
    p.add_argument("--churn-warmup", type=int, default=200, help="churn events not checked")
    p.add_argument(
        "--churn-gap-ms",
        type=number(float, 0, 1000),
        default=0.0,
        help="an untimed pause (ms) after each churn event on every engine, standing in for the "
        "forward a server runs between two scheduler steps (0: back to back, the default)",
    )
    p.add_argument(
        "--ci-width",
        type=_fraction,
        default=CI_WIDTH,
        help="stop adding rounds once the bridged/native 95%% interval is within +- this "
        "fraction of its median (0.02)",
    )
    p.add_argument(
        "--max-spare-pages",
        type=int,
        default=None,
        help="passed to the bridge (default: the bridge's own, "
        "kvledger.engines.sglang.bridge.bridge.DEFAULT_POOL_OPTIONS)",
    )
    p.add_argument("--seed", type=int, default=13)
    p.add_argument(
        "--threads",
        type=_positive,
        default=1,
        help="torch intra-op threads (1: the engines' small tensor ops, measured alike)",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON too")


def add_serving_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("serving (--part serving)")
    g.add_argument(
        "--serving-forward-ms",
        default=",".join(f"{x:g}" for x in serving.FORWARD_MS),
        help="forward stand-in times (ms), comma-separated (5,15,40)",
    )
    g.add_argument(
        "--serving-compaction",
        default="0",
        help="compaction settings, comma-separated: off (KVLEDGER_SGLANG_DSV4_COMPACT=0), N "
        "(slack N), env (as the environment says); the first runs at every forward time, the "
        "others at --serving-curve-ms (0)",
    )
    g.add_argument(
        "--serving-curve-ms",
        type=number(float, 0, 1000),
        default=None,
        help="the forward time of the compaction curve (the first of --serving-forward-ms)",
    )
    g.add_argument(
        "--serving-compact",
        choices=("step", "idle"),
        default="step",
        help="where the bridged loop takes a compaction step: step (after each batch result, "
        "the next batch in flight) or idle (only with no batch in flight, as the plugin does "
        "under SGLang's overlap loop)",
    )
    g.add_argument(
        "--serving-control",
        action="store_true",
        help="a second native engine through the same trace, interleaved with the others: "
        "native/native tokens/s is the loop's own spread (what a ratio can resolve)",
    )
    g.add_argument("--serving-rounds", type=_positive, default=10, help="rounds a variant (10)")
    g.add_argument("--serving-steps", type=_positive, default=100, help="steps a round (100)")
    g.add_argument(
        "--serving-cold-compaction",
        action="store_true",
        help="attach the bridge without its compaction warm-up (the first compaction then "
        "loads its kernels inside a serving step)",
    )
    g.add_argument(
        "--serving-warmup-steps",
        type=number(int, 0, 100000),
        default=0,
        help="untimed steps of every variant before the rounds (0)",
    )
    g.add_argument(
        "--serving-rate",
        type=number(float, 0.001, 1000),
        default=0.3,
        help="Poisson arrivals per step (0.3)",
    )
    g.add_argument("--serving-prompt-median", type=number(float, 1, 1e6), default=1024.0)
    g.add_argument("--serving-prompt-max", type=_positive, default=8192)
    g.add_argument("--serving-output-median", type=number(float, 1, 1e6), default=128.0)
    g.add_argument("--serving-output-max", type=_positive, default=1024)
    g.add_argument("--serving-max-running", type=_positive, default=64, help="(64)")
    g.add_argument("--serving-prefill-tokens", type=_positive, default=8192, help="a step's (8192)")
    g.add_argument("--serving-swa-pages", type=_positive, default=512, help="(512)")
    g.add_argument(
        "--serving-full-pages", type=_positive, default=2048, help="full-token pages (2048)"
    )


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return v


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number in (0, 1)") from None
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number in (0, 1)")
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
    torch.set_num_threads(args.threads)
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
    results: dict[str, Any] = {}
    if args.part in ("all", "allocator"):
        results = cases.run_all(
            args,
            threads=torch.get_num_threads(),
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
        for line in report(results):
            print(line)
    if args.part in ("all", "holders"):
        from kvledger.tools.bench import sglang_holders

        results["holders"] = sglang_holders.holders_cost(
            layers=args.layers,
            requests=args.holders_requests,
            rounds=args.holders_rounds,
            steps=args.holders_steps,
            device=args.device,
        )
        for line in sglang_holders.report(results["holders"]):
            print(line)
    if args.part == "serving":
        results["serving"] = serving.run_serving(
            args, progress=lambda line: print(line, file=sys.stderr, flush=True)
        )
        for line in serving.report(results["serving"]):
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


def _ci(d: dict[str, Any]) -> str:
    return (
        f"{d['median']:.3f}x [{d['low']:.3f}, {d['high']:.3f}] (+-{d['half_width']:.1%}; "
        f"rounds {d['min']:.3f}..{d['max']:.3f})"
    )


def _verdict(v: str) -> str:
    return {bootstrap.MET: "met", bootstrap.NOT_MET: "NOT met"}.get(v, "not resolved")


CASES = (
    ("decode_step", "decode step", "round of {steps} steps"),
    ("round_trip_4096", "4096-token alloc+release", "round of {trips} trips"),
    ("fill_drain", "fill/drain cycle", "round of one cycle"),
    ("churn_event", "churn", "round of {churn_round} events"),
)


def churn_bound_line(ch: dict[str, Any]) -> str:
    """The churn samples against the packing bound (what the target judges) and, with a
    compaction slack, against the bound + slack (what that policy keeps)."""
    slack = ch.get("slack", 0)
    line = (
        f"    mapped page ids - bound: max {ch['excess_max']:+d}, samples over {ch['over']} of "
        f"{ch['checked']}; mapped max {ch['mapped_max']}, bound at that sample {ch['bound_at_max']}"
    )
    if slack:
        line += (
            f"; the policy's slack {slack} (KVLEDGER_SGLANG_DSV4_COMPACT_SLACK): samples over "
            f"bound + {slack} {ch['over_slack']}"
        )
    return line


def report(r: dict[str, Any]) -> list[str]:
    c = r["config"]
    width = c["ci_width"]
    out = [
        f"bench sglang: SGLang {c['sglang']}, torch {c['torch']} ({c['threads']} intra-op "
        f"threads), device {c['device']}, backend {c['backend']} (granularity "
        f"{c['granularity']} bytes, {c['rows_per_vmm_page']:.3f} SWA rows per VMM page)",
        f"  {c['requests']} requests x {c['prompt']}-token prompts, {c['decode_tokens']} decode "
        f"tokens; page {c['page']}, window {c['window']}; {c['layers']} layers, "
        f"{c['swa_pages']} SWA pages; bridge: ledger + publisher (1 s), max_spare_pages "
        f"{c['max_spare_pages']}",
        f"  each case timed as whole rounds (every step and replay), paired by round with "
        f"native; median of the per-round ratios [95% bootstrap interval over rounds, "
        f"{bootstrap.RESAMPLES} resamples, seed {bootstrap.SEED}]; rounds added until "
        f"bridged/native is within +-{width:.0%} and on one side of the target",
    ]
    targets = []
    for key, title, unit in CASES:
        case = r[key]
        pr = case["paired"]
        b, k = pr["bridged"], pr["control"]
        out.append(f"  {title} ({unit.format(**c)}; {pr['rounds']} rounds):")
        for name in ("native", "control", "bridged"):
            out.append(f"    {name:8s} {_ms(case[name])}")
        extra = ""
        if "bridged_maps" in case:
            extra = f"; bridged maps {case['bridged_maps']}, unmaps {case['bridged_unmaps']}"
        out.append(f"    bridged/native {_ci(b)}{extra}")
        out.append(f"    control/native {_ci(k)} (the resolution)")
        if b["half_width"] > width + 1e-12:
            out.append(
                f"    not resolved to +-{width:.0%} within {pr['rounds']} rounds: bridged/native "
                f"+-{b['half_width']:.1%}, control/native +-{k['half_width']:.1%} (this "
                f"machine's spread between two identical engines)"
            )
        steps = case.get("steps")
        if steps is not None:  # the figure the bench printed before it timed whole rounds
            ratio = steps["bridged"]["median"] / steps["native"]["median"]
            means = steps["bridged"]["mean"] / steps["native"]["mean"]
            out.append(
                f"    per step (not judged: a step's median leaves out the replays): median "
                f"{ratio:.3f}x, mean {means:.3f}x bridged/native"
            )
        limit = TARGETS[key]
        ci = cases.interval_of(case)
        targets.append(
            f"  target {title} <= {limit}x native: {_verdict(ci.verdict(limit))} "
            f"({ci.median:.3f}x, 95% interval [{ci.low:.3f}, {ci.high:.3f}])"
        )
    fd = r["fill_drain"]
    out.append(
        "  maps per fill/drain cycle (page ids mapped; fewest possible = VMM pages touched by "
        "the SWA rows SGLang held during the cycle, row 0 included, less the page ids already "
        "mapped when it began; packed = ceil(peak rows held at once / rows per VMM page) "
        "less those mapped):"
    )
    # every cycle's maps over its fewest, by value; the cycles off the commonest one listed
    by_ratio: dict[str, list[int]] = {}
    for i, cy in enumerate(fd["cycles"]):
        by_ratio.setdefault(f"{cy['maps'] / max(cy['fewest'], 1):.2f}x", []).append(i)
    common = max(by_ratio, key=lambda k: len(by_ratio[k]))
    out.append(
        "    "
        + ", ".join(f"{k} fewest: {len(v)} cycles" for k, v in sorted(by_ratio.items()))
        + f"; overall {sum(cy['maps'] for cy in fd['cycles'])} maps for "
        f"{sum(cy['fewest'] for cy in fd['cycles'])} fewest"
    )
    for i, cy in enumerate(fd["cycles"]):
        if i < 2 or i not in by_ratio[common]:
            out.append(
                f"    cycle {i}: maps {cy['maps']:4d}  unmaps {cy['unmaps']:4d}  fewest "
                f"{cy['fewest']:4d}  packed {cy['packed']:4d}  "
                f"({cy['maps'] / max(cy['fewest'], 1):.2f}x fewest)"
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
        f"of the production compaction policy ({ch['rows_moved']} rows moved); "
        + (
            f"an untimed {c['churn_gap_ms']:g} ms pause after each event"
            if c.get("churn_gap_ms")
            else "events back to back"
        )
    )
    out.append(memory_line(ch["swa_memory"], ch["compaction"]))
    out.append(churn_bound_line(ch))
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
        targets.append("  target no allocation waits on a driver call: n/a, not counted")
    else:
        line = f"  allocations that waited on a driver call ({COUNTER_DRIVER_WAITS}): {waits}"
        by_case = r.get("driver_waits_by_case") or {}
        if by_case:
            line += " (" + ", ".join(f"{k} {n}" for k, n in by_case.items()) + ")"
        targets.append(f"  target no allocation waits on a driver call: {_met(waits == 0)}")
    out.append(line)
    out.append("targets:")
    out.extend(targets)
    return out
