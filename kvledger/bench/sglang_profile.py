"""Where a `kvledger bench sglang` case spends its time: native and bridged, profiled side by side.

    python -m kvledger.bench.sglang_profile --case round_trip [bench sglang options]

Builds the bench's engines (`sglang_cases.variants`), warms them as the bench does, then runs
`--profile-rounds` rounds of the case on the native and the bridged engine, alternating which
goes first, with `cProfile` on only while a round is timed (the untimed `wait_idle` between
rounds is left out). Prints each engine's median round, its functions by own time, the
functions the bridged engine spends more own time in than native, and the bridged engine's
kvledger and allocator functions by cumulative time. The profiler slows both engines; read
the differences, not the absolute times. Cases: `round_trip` (a round of `--trips` 4096-token
round trips), `decode_step` (a round of `--steps` decode steps), `churn` (a round of
`--churn-round` churn events, each with a step of the production compaction policy and
`--churn-gap-ms` untimed after it). On Python 3.12 and later the profile also holds other
threads' calls (the background mapper's waits show as its cumulative time).

docs/benchmarks.md quotes what it found on the H200 for the round trip and the churn.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from kvledger.argtypes import one_line_errors
from kvledger.bench import sglang_cases as cases
from kvledger.bench.sglang import add_arguments

CASES = ("round_trip", "decode_step", "churn")
Row = tuple[float, float, int]  # own seconds, cumulative seconds, calls


def _name(func: tuple[str, int, str]) -> str:
    """A function's place, its path from the package root (site-packages or this tree)."""
    path, line, fn = func
    for root in ("site-packages/", "/kvledger/", "/allocator/", "/accounting/"):
        i = path.find(root)
        if i >= 0:
            path = path[i + len(root) :] if root == "site-packages/" else path[i + 1 :]
            break
    return f"{path}:{line}:{fn}"


def rows(profile: cProfile.Profile) -> dict[str, Row]:
    """Every profiled function: (own seconds, cumulative seconds, calls)."""
    stats: dict[Any, Any] = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return {_name(f): (v[2], v[3], v[1]) for f, v in stats.items()}


class _Timer:
    """A round's timed part: the profiler on and the clock running only inside `timed()`."""

    def __init__(self, profile: cProfile.Profile | None) -> None:
        self.profile = profile
        self.seconds = 0.0

    def __enter__(self) -> _Timer:
        if self.profile is not None:
            self.profile.enable()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.perf_counter() - self._t0
        if self.profile is not None:
            self.profile.disable()


def _rounds(args: Any, v: Any, policy: Any) -> Callable[[cProfile.Profile | None], float]:
    """One round of `args.case` on variant `v`: returns its timed seconds (the replays at
    its end included; the churn's pauses not)."""
    e = v.engine
    churn = cases.Churn(args.seed, args.swa_pages)

    def one(profile: cProfile.Profile | None) -> float:
        timer = _Timer(profile)
        if args.case == "churn":
            for _ in range(args.churn_round):
                with timer:
                    churn.event(e)
                    cases.compact_between_events(v, policy)
                if args.churn_gap_ms:
                    time.sleep(args.churn_gap_ms / 1000)  # untimed, as in the bench
        else:
            step = cases.round_trip if args.case == "round_trip" else cases.decode_step
            with timer:
                for _ in range(args.trips if args.case == "round_trip" else args.steps):
                    step(e, args)
        with timer:
            cases._settle(v)
        return timer.seconds

    return one


def run(args: argparse.Namespace, out: Any = sys.stdout) -> dict[str, Any]:
    """Profile `args.case` (see the module docstring); prints the tables to `out` and
    returns the round seconds and the profile rows per engine."""
    import torch

    from kvledger.sglang.bridge.compact_policy import CompactionPolicy

    torch.set_num_threads(args.threads)
    cases.apply_defaults(args)
    with cases.variants(args) as vs:
        native, _, bridged = vs
        engines = (native, bridged)
        policy = CompactionPolicy.from_env()
        for v in engines:
            if args.case == "round_trip":
                cases.round_trip(v.engine, args)
            elif args.case == "decode_step":
                cases.ramp_up(v.engine, args)
            else:
                v.engine.finish_all()
            cases._quiesce(v)
        rounds = {v.name: _rounds(args, v, policy) for v in engines}
        profiles = {v.name: cProfile.Profile() for v in engines}
        seconds: dict[str, list[float]] = {v.name: [] for v in engines}
        for i in range(args.warm_rounds + args.profile_rounds):
            for v in engines if i % 2 else engines[::-1]:
                if i < args.warm_rounds:
                    rounds[v.name](None)
                else:
                    seconds[v.name].append(rounds[v.name](profiles[v.name]))
                cases._quiesce(v)  # untimed, unprofiled: what the bench does between rounds
        got = {k: rows(p) for k, p in profiles.items()}
    report(seconds, got, args.top, out)
    return {"seconds": seconds, "rows": got}


def report(
    seconds: dict[str, list[float]], got: dict[str, dict[str, Row]], top: int, out: Any
) -> None:
    """The tables `run` prints."""
    for k, t in seconds.items():
        print(
            f"{k}: median round {statistics.median(t) * 1e3:.3f} ms (n={len(t)}, profiled)",
            file=out,
        )
    for k, r in got.items():
        print(f"== {k}: own time", file=out)
        for name, (own, cum, calls) in sorted(r.items(), key=lambda x: -x[1][0])[:top]:
            print(
                f"  {own * 1e3:9.2f} ms own {cum * 1e3:9.2f} cum {calls:7d} calls  {name}", file=out
            )
    a, b = got["native"], got["bridged"]
    zero: Row = (0.0, 0.0, 0)
    print("== bridged - native, own time", file=out)
    for name in sorted(set(a) | set(b), key=lambda n: a.get(n, zero)[0] - b.get(n, zero)[0])[:top]:
        diff = b.get(name, zero)[0] - a.get(name, zero)[0]
        print(
            f"  {diff * 1e3:9.2f} ms  (bridged cum {b.get(name, zero)[1] * 1e3:8.2f})  {name}",
            file=out,
        )
    print("== bridged: kvledger and allocator functions by cumulative time", file=out)
    ours = [(n, x) for n, x in b.items() if n.startswith(("kvledger/", "allocator/"))]
    for name, (own, cum, calls) in sorted(ours, key=lambda x: -x[1][1])[:top]:
        print(f"  {cum * 1e3:9.2f} ms cum {own * 1e3:8.2f} own {calls:7d}  {name}", file=out)


def parser() -> argparse.ArgumentParser:
    """The bench's options and this tool's own."""
    p = argparse.ArgumentParser(
        prog="python -m kvledger.bench.sglang_profile", description=(__doc__ or "").split("\n")[0]
    )
    one_line_errors(p)
    add_arguments(p)
    p.add_argument("--case", choices=CASES, default="round_trip")
    p.add_argument("--profile-rounds", type=int, default=20, help="profiled rounds per engine (20)")
    p.add_argument("--warm-rounds", type=int, default=3, help="unprofiled rounds first (3)")
    p.add_argument("--top", type=int, default=25, help="lines per table (25)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.profile_rounds < 1 or args.warm_rounds < 0 or args.top < 1:
        p.error(
            f"--profile-rounds={args.profile_rounds} --warm-rounds={args.warm_rounds} "
            f"--top={args.top}: expected >= 1, >= 0 and >= 1"
        )
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
