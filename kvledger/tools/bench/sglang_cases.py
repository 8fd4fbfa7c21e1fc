"""The cases of `kvledger bench sglang` (see `kvledger.tools.bench.sglang`), native and bridged.

Every case is timed as whole rounds (`run_rounds`): in each round each engine runs the
case's whole round of work back to back, the order rotating, and a round's time is all of
it, every step and every journal replay its calls caused included (the bridged engine's
journal is flushed inside the timed round, so what its hooks recorded is paid for in the
round that recorded it); only the bench's own bookkeeping between steps (rows touched,
mapped page ids checked) is left out. The ratios are paired by round
(`kvledger.tools.bench.bootstrap`): rounds continue past the minimum until the bridged/native
interval is within the width asked for, or the maximum is reached.

Bridge figures are read through the bridge's public API (`Bridge.stats()` between
cases, `Bridge.backend.granularity`), its page store's `stats()` between steps (which
replays nothing: `Bridge.stats()` replays the journal first, work no round would time) and
the ledger the bench gave it (the `swa_kv` VMM account's map and unmap totals, in page
ids).
"""

from __future__ import annotations

import contextlib
import gc
import math
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from accounting.ledger import Account, Ledger
from accounting.snapfile.writer import Publisher
from kvledger.engines.sglang.bridge.compact_policy import CompactionPolicy
from kvledger.tools.bench import bootstrap
from kvledger.tools.bench.sglang_engine import (
    PAGE,
    WINDOW,
    Engine,
    Request,
    Shape,
    attach_bridge,
    published,
    swa_vmm_account,
)
from kvledger.tools.bench.sglang_memory import SwaMemory

# The counter of allocations that waited for a driver map (Bridge.stats(), docs/sglang-bridge.md).
COUNTER_DRIVER_WAITS = "waited_allocs"
ROUND_TRIP_TOKENS = 4096
CHURN_LOW, CHURN_HIGH = 0.10, 0.90
CHECK_EVERY = 10  # rounds between two looks at whether the interval is narrow enough
# The targets, bridged/native at most (issue 23), by case; judged on the interval's ends.
TARGETS = {"decode_step": 1.03, "round_trip_4096": 1.05, "fill_drain": 1.3, "churn_event": 1.3}


@dataclass
class Variant:
    name: str
    engine: Engine
    bridge: Any = None
    account: Account | None = None

    def map_totals(self) -> tuple[int, int]:
        if self.account is None:
            return 0, 0
        return self.account.pages_mapped_total, self.account.pages_unmapped_total

    # The bench's own reads of the bridge: the page store's figures as they are, never a
    # replay of the journal (`Bridge.stats()` replays first: work the rounds would not time).
    def mapped_pages(self) -> int:
        return self.mapped_spare_physical()[0]

    def mapped_spare_physical(self) -> tuple[int, int, int]:
        if self.bridge is None:
            return 0, 0, 0
        stats = self.bridge.store.stats()
        return int(stats["mapped_pages"]), int(stats["spare_pages"]), int(stats["physical_bytes"])


def summary(seconds: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(seconds),
        "mean": statistics.fmean(seconds),
        "min": min(seconds),
        "max": max(seconds),
        "n": len(seconds),
    }


Variants = tuple[Variant, ...]


def paired(per_round: dict[str, list[float]]) -> dict[str, Any]:
    """The ratios paired by round (each engine's round time over native's in the same round):
    for `bridged` and `control`, the median with its 95 % bootstrap interval
    (`bootstrap.paired_ratio`, fixed seed) and the min and max of the per-round ratios."""
    out: dict[str, Any] = {"rounds": len(per_round["native"])}
    for name in ("bridged", "control"):
        r = bootstrap.ratios(per_round[name], per_round["native"])
        ci = bootstrap.median_ci(r)
        out[name] = {**ci.as_dict(), "min": min(r), "max": max(r)}
    return out


def _interval(pr: dict[str, Any], name: str) -> bootstrap.Interval:
    d = pr[name]
    return bootstrap.Interval(
        d["median"], d["low"], d["high"], d["n"], d["level"], d["resamples"], d["seed"]
    )


def interval_of(case: dict[str, Any], name: str = "bridged") -> bootstrap.Interval:
    """The paired interval of `name` (bridged or control) over native in a case's results."""
    return _interval(case["paired"], name)


def _order(vs: Variants, i: int) -> Variants:
    """Round `i`'s order: every engine goes first in turn."""
    k = i % len(vs)
    return vs[k:] + vs[:k]


def _quiesce(v: Variant) -> None:
    """After an engine's round, untimed: the bridged engine's background mapper finishes
    what the round left it (maps ahead, spares past their grace), so that none of it runs
    while the next engine's round is timed, a cost charged to the wrong engine."""
    if v.bridge is not None:
        v.bridge.wait_idle()


def run_rounds(
    vs: Variants,
    one_round: Callable[[Variant, int], float],
    *,
    least: int,
    most: int,
    width: float,
    target: float | None = None,
) -> dict[str, list[float]]:
    """Round times per engine: `one_round(variant, i)` returns the seconds of round `i` of
    that engine (all of it: every step and replay). At least `least` rounds; then every
    CHECK_EVERY rounds, stop once the bridged/native interval is within +-`width` and, with
    a `target`, lies wholly on one side of it (met or not met); at most `most` rounds."""
    times: dict[str, list[float]] = {v.name: [] for v in vs}
    i = 0
    while i < most:
        for v in _order(vs, i):
            gc.collect()
            times[v.name].append(one_round(v, i))
            _quiesce(v)
        i += 1
        if i >= least and (i - least) % CHECK_EVERY == 0:
            ratio = bootstrap.ratios(times[bridged_of(vs).name], times["native"])
            ci = bootstrap.median_ci(ratio)
            if ci.within(width) and (
                target is None or ci.verdict(target) != bootstrap.NOT_RESOLVED
            ):
                break
    return times


def bridged_of(vs: Variants) -> Variant:
    return next(v for v in vs if v.bridge is not None)


def apply_defaults(args: Any) -> None:
    """`--max-spare-pages` left unset: the bridge's own policy."""
    from kvledger.engines.sglang.bridge.bridge import DEFAULT_POOL_OPTIONS

    if args.max_spare_pages is None:
        args.max_spare_pages = int(DEFAULT_POOL_OPTIONS["max_spare_pages"])


def geometry_of(bridged: Variant) -> tuple[int, int]:
    """(bytes of an SWA row, bytes of a VMM page) of the bridged engine."""
    row_bytes = int(bridged.engine.pool.swa_kv_pool.kv_buffer[0].shape[1])
    return row_bytes, int(bridged.bridge.backend.granularity)


def churn_bound(held: int, geometry: tuple[int, int], max_spare_pages: int) -> int:
    """The page ids the churn case allows mapped: ceil(held rows / rows per VMM page) +
    max spare pages + 1, the held rows with row 0."""
    rb, gran = geometry
    return math.ceil((held + 1) * rb / gran) + max_spare_pages + 1


def shape_for(args: Any) -> Shape:
    per_req = -(-(args.prompt + args.decode_tokens) // PAGE)
    trip = ROUND_TRIP_TOKENS // PAGE
    need_swa = 2 * args.requests + trip + -(-args.prompt // PAGE) + 2
    if args.swa_pages < need_swa:
        raise ValueError(
            f"--swa-pages={args.swa_pages}: the steady state needs about {need_swa} SWA pages "
            f"for {args.requests} requests (2 each) and a {ROUND_TRIP_TOKENS}-token admission"
        )
    max_context = -(-max(args.prompt + args.decode_tokens, ROUND_TRIP_TOKENS) // PAGE) * PAGE
    return Shape(
        layers=args.layers,
        swa_pages=args.swa_pages,
        full_pages=max(args.requests * per_req + trip + per_req + 8, args.swa_pages + 2 * trip),
        requests=args.requests + 1,
        max_context=max_context,
    )


@contextlib.contextmanager
def variants(args: Any) -> Iterator[Variants]:
    """`native` and `control` (two identical native engines: how far apart the same thing
    reads on this machine, the resolution of the ratios) and `bridged`."""
    shape = shape_for(args)
    device = "cuda:0" if args.device == "cuda" else "cpu"
    with published(), contextlib.ExitStack() as stack:
        native = Variant("native", Engine(shape, device))
        control = Variant("control", Engine(shape, device))
        engine = Engine(shape, device)
        ledger = Ledger({"model_name": "kvledger-bench-sglang"})
        directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvledger-bench-"))
        bridge = attach_bridge(engine, ledger, {"max_spare_pages": args.max_spare_pages})
        stack.callback(bridge.detach)
        stack.enter_context(Publisher(ledger, directory, interval=1.0, source="bench"))
        account = swa_vmm_account(ledger)
        yield native, control, Variant("bridged", engine, bridge, account)


# -- the workload --------------------------------------------------------------------------------
def decode_step(e: Engine, args: Any) -> None:
    """Window eviction + one decode token each + finish what is done + admit as many (while
    filling up: requests / decode tokens a step, so that the requests stay staggered)."""
    e.evict_windows()
    e.decode()
    done = [r for r in e.running if r.decoded >= args.decode_tokens]
    for r in done:
        e.finish(r)
    per_step = -(-args.requests // args.decode_tokens)
    for _ in range(min(args.requests - len(e.running), max(len(done), per_step))):
        e.prefill(args.prompt)
    e.sync()


def round_trip(e: Engine, args: Any) -> None:
    """Admit a 4096-token request and finish it, on top of the running batch."""
    e.finish(e.prefill(ROUND_TRIP_TOKENS))
    e.sync()


def ramp_up(e: Engine, args: Any) -> None:
    """Up to `requests` staggered requests, then 64 steps more to settle."""
    while len(e.running) < args.requests:
        decode_step(e, args)
    for _ in range(64):
        decode_step(e, args)


@dataclass(frozen=True)
class TimedCase:
    """A case of repeated steps: `warm` once per engine, then in each round `step`
    `getattr(args, per_round)` times on each engine in turn."""

    warm: Callable[[Engine, Any], None]
    step: Callable[[Engine, Any], None]
    per_round: str  # the argument giving the steps of one round
    key: str  # the case's name in the results (and in TARGETS)


DECODE_STEP = TimedCase(warm=ramp_up, step=decode_step, per_round="steps", key="decode_step")
ROUND_TRIP = TimedCase(warm=round_trip, step=round_trip, per_round="trips", key="round_trip_4096")


def _settle(v: Variant) -> None:
    """The end of a bridged round, timed with it: replay what its hooks recorded, on this
    thread (what the next replay would have done; the round's calls caused it)."""
    if v.bridge is not None:
        v.bridge.flush()


def _timed(fn: Callable[..., None], *args: Any) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def limits(args: Any, case: str) -> tuple[int, int]:
    """(least, most) rounds of `case` ("steps", "cycles" or "churn")."""
    if case == "cycles":
        return args.cycles, max(args.cycles, args.max_cycles)
    if case == "churn":
        least = -(-args.churn_events // args.churn_round)
        return least, max(least, args.max_rounds)
    return args.rounds, max(args.rounds, args.max_rounds)


def bench_timed(vs: Variants, args: Any, case: TimedCase) -> dict[str, Any]:
    """Each engine's round times (every step and the replays, `run_rounds`), the ratios
    paired by round, the steps' own times (their median is what the bench reported before
    it timed whole rounds: it leaves out the replays) and the bridged engine's maps and
    unmaps over the timed rounds."""
    for v in vs:
        case.warm(v.engine, args)
    steps_of: dict[str, list[float]] = {v.name: [] for v in vs}
    steps = getattr(args, case.per_round)
    bridged = bridged_of(vs)
    m0, u0 = bridged.map_totals()

    def one_round(v: Variant, i: int) -> float:
        got = []
        t0 = time.perf_counter()
        for _ in range(steps):
            t1 = time.perf_counter()
            case.step(v.engine, args)
            got.append(time.perf_counter() - t1)
        _settle(v)
        seconds = time.perf_counter() - t0
        steps_of[v.name] += got
        return seconds

    least, most = limits(args, "steps")
    times = run_rounds(
        vs, one_round, least=least, most=most, width=args.ci_width, target=TARGETS[case.key]
    )
    m1, u1 = bridged.map_totals()
    return {
        **{k: summary(t) for k, t in times.items()},
        "steps": {k: summary(t) for k, t in steps_of.items()},
        "paired": paired(times),
        "bridged_maps": m1 - m0,
        "bridged_unmaps": u1 - u0,
    }


def _vmm_pages(row: int, row_bytes: int, gran: int) -> range:
    return range(row * row_bytes // gran, ((row + 1) * row_bytes - 1) // gran + 1)


def _evict_one(e: Engine, req: Request) -> None:
    e.evict_windows([req])
    e.sync()


def _finish_one(e: Engine, req: Request) -> None:
    e.finish(req)
    e.sync()


def fill_drain(v: Variant, args: Any, geometry: tuple[int, int] | None) -> dict[str, Any]:
    """One cycle from empty to `requests` requests and back; with `geometry` (row bytes,
    granularity) also the rows SGLang held (untimed) and the maps the bridge made."""
    e = v.engine
    seconds = 0.0
    touched: set[int] = set()
    peak = 0
    start_mapped = v.mapped_pages()
    m0, u0 = v.map_totals()
    for _ in range(args.requests):
        t0 = time.perf_counter()
        req: Request = e.prefill(args.prompt)
        e.sync()
        seconds += time.perf_counter() - t0
        if geometry is not None:
            rb, gran = geometry
            for p in [0, *e.swa_pages_of(req)]:
                touched.update(_vmm_pages(p, rb, gran))
            peak = max(peak, e.held_swa_pages())
        seconds += _timed(_evict_one, e, req)
    for r in list(e.running):
        seconds += _timed(_finish_one, e, r)
    seconds += _timed(_settle, v)  # the replays the cycle's calls left, timed with it
    out: dict[str, Any] = {"seconds": seconds}
    if geometry is not None:
        rb, gran = geometry
        m1, u1 = v.map_totals()
        out.update(
            maps=m1 - m0,
            unmaps=u1 - u0,
            fewest=max(0, len(touched) - start_mapped),
            packed=max(0, math.ceil((peak + 1) * rb / gran) - start_mapped),
        )
    return out


def bench_fill_drain(vs: Variants, args: Any, geometry: tuple[int, int]) -> dict[str, Any]:
    """One cycle per engine per round (`fill_drain`, its replays included), the ratios paired
    by round, and the bridged engine's maps per cycle."""
    for v in vs:
        v.engine.finish_all()
        fill_drain(v, args, None)  # warm
        _quiesce(v)
    cycles = []

    def one_round(v: Variant, i: int) -> float:
        r = fill_drain(v, args, geometry if v.bridge is not None else None)
        seconds = float(r.pop("seconds"))
        if r:
            cycles.append(r)
        return seconds

    least, most = limits(args, "cycles")
    times = run_rounds(
        vs, one_round, least=least, most=most, width=args.ci_width, target=TARGETS["fill_drain"]
    )
    return {**{k: summary(t) for k, t in times.items()}, "paired": paired(times), "cycles": cycles}


class Churn:
    """Random admissions (1..4096-token prompts) and finishes of random requests, sweeping
    SWA occupancy up to 90% and down to 10% and back: admissions win 70% of the draws
    while rising, 30% while falling. The same seed gives the same trace on any engine
    whose SGLang allocator holds the same page counts."""

    def __init__(self, seed: int, swa_pages: int) -> None:
        self.rng = random.Random(seed)
        self.swa_pages = swa_pages
        self.rising = True
        self.done = 0

    def event(self, e: Engine) -> str:
        rng = self.rng
        occupancy = e.held_swa_pages() / self.swa_pages
        if occupancy >= CHURN_HIGH:
            self.rising = False
        elif occupancy <= CHURN_LOW:
            self.rising = True
        admit = rng.random() < (0.7 if self.rising else 0.3)
        n = rng.randint(1, ROUND_TRIP_TOKENS)
        pick = rng.random()
        fits = e.held_swa_pages() + -(-n // PAGE) <= CHURN_HIGH * self.swa_pages + 1
        self.done += 1
        if (admit or not e.running) and fits and e.r2t.available_size() > 0:
            e.prefill(n)
            e.sync()
            return "admit"
        e.finish(e.running[int(pick * len(e.running))])
        e.sync()
        return "finish"


def compact_between_events(v: Variant, policy: CompactionPolicy) -> None:
    """The churn case's one compaction call site: between two events (no batch holds
    translated SWA ids), timed with the event: one step of the production compaction policy,
    exactly as the plugin runs it between batches (`kvledger.engines.sglang.bridge.compact_policy`)."""
    if v.bridge is not None:
        policy.step(v.bridge)
        v.engine.sync()


def bench_churn(vs: Variants, args: Any, geometry: tuple[int, int]) -> dict[str, Any]:
    """Rounds of `--churn-round` events per engine (the same trace on each: the same seed and
    page counts), each event timed with its compaction; after each of the bridged engine's
    events past the warm-up (untimed) its mapped page ids are checked against the bound."""
    rb = geometry[0]
    per_round = args.churn_round
    gap = args.churn_gap_ms / 1000
    state = {v.name: Churn(args.seed, args.swa_pages) for v in vs}
    kinds = {"admit": 0, "finish": 0}
    occ: list[float] = []
    samples: list[tuple[int, int]] = []  # (mapped, bound) after warm-up
    spares: list[int] = []  # spare page ids at each of those samples
    # The production compaction policy, exactly as the plugin runs it (one step per event).
    policy = CompactionPolicy.from_env()
    memory = SwaMemory(row_bytes=rb, layers=args.layers, rows=args.swa_pages)
    for v in vs:
        v.engine.finish_all()
        _quiesce(v)

    def one_round(v: Variant, i: int) -> float:
        churn = state[v.name]
        e = v.engine
        seconds = 0.0
        for _ in range(per_round):
            t0 = time.perf_counter()
            kind = churn.event(e)
            compact_between_events(v, policy)
            seconds += time.perf_counter() - t0
            if gap:
                time.sleep(gap)  # untimed: the forward between two scheduler steps
            if v.bridge is None:
                continue
            kinds[kind] += 1
            held = e.held_swa_pages()
            occ.append(held / args.swa_pages)
            if churn.done > args.churn_warmup:
                bound = churn_bound(held, geometry, args.max_spare_pages)
                mapped, spare, physical = v.mapped_spare_physical()
                samples.append((mapped, bound))
                spares.append(spare)
                memory.add(physical, held)
        return seconds + _timed(_settle, v)

    least, most = limits(args, "churn")
    times = run_rounds(
        vs, one_round, least=least, most=most, width=args.ci_width, target=TARGETS["churn_event"]
    )
    for v in vs:
        v.engine.finish_all()
    excess = [m - b for m, b in samples]
    worst = max(range(len(samples)), key=lambda i: samples[i][0])
    events = state["native"].done
    return {
        **{k: summary(t) for k, t in times.items()},
        "paired": paired(times),
        "rows_moved": int(bridged_of(vs).bridge.stats()["rows_moved"]),
        "compaction": {**policy.stats(), "describe": policy.describe()},
        "swa_memory": memory.result(),
        "events": events,
        "round_events": per_round,
        "admits": kinds["admit"],
        "finishes": kinds["finish"],
        "occupancy_min": min(occ[args.churn_warmup :]),
        "occupancy_max": max(occ[args.churn_warmup :]),
        "warmup": args.churn_warmup,
        "checked": len(samples),
        "over": sum(1 for x in excess if x > 0),
        # The policy's own promise with a slack (KVLEDGER_SGLANG_DSV4_COMPACT_SLACK): within
        # the bound + slack; the bound itself is what the churn target judges.
        "slack": policy.excess_pages,
        "over_slack": sum(1 for x in excess if x > policy.excess_pages),
        "excess_max": max(excess),
        "mapped_max": samples[worst][0],
        "bound_at_max": samples[worst][1],
        # The two parts of the excess: spares the policy keeps, and page ids in use beyond
        # the packed rows (held rows scattered over pages, which no allocation order undoes).
        "spares_max": max(spares),
        "in_use_excess_max": max(
            m - s - (b - args.max_spare_pages - 1)
            for (m, b), s in zip(samples, spares, strict=True)
        ),
    }


def run_all(
    args: Any, *, threads: int, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Every case on the three engines; `progress` gets a line after each case."""
    import importlib.metadata

    import torch

    apply_defaults(args)

    with variants(args) as vs, _frozen_heap():
        bridge = bridged_of(vs).bridge
        geometry = geometry_of(bridged_of(vs))
        row_bytes, gran = geometry
        results: dict[str, Any] = {
            "config": {
                "sglang": importlib.metadata.version("sglang"),
                "torch": torch.__version__,
                "threads": threads,
                "device": args.device,
                "backend": type(bridge.backend).__name__,
                "granularity": gran,
                "row_bytes": row_bytes,
                "rows_per_vmm_page": gran / row_bytes,
                "requests": args.requests,
                "prompt": args.prompt,
                "decode_tokens": args.decode_tokens,
                "page": PAGE,
                "window": WINDOW,
                "layers": args.layers,
                "swa_pages": args.swa_pages,
                "max_spare_pages": args.max_spare_pages,
                "steps": args.steps,
                "trips": args.trips,
                "churn_round": args.churn_round,
                "churn_gap_ms": args.churn_gap_ms,
                "ci_width": args.ci_width,
                "rounds": args.rounds,
                "max_rounds": args.max_rounds,
                "cycles": args.cycles,
                "max_cycles": args.max_cycles,
                "bootstrap": {
                    "level": bootstrap.LEVEL,
                    "resamples": bootstrap.RESAMPLES,
                    "seed": bootstrap.SEED,
                },
            }
        }
        waits_by_case: dict[str, int] = {}
        cases: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("decode_step", lambda: bench_timed(vs, args, DECODE_STEP)),
            ("round_trip_4096", lambda: bench_timed(vs, args, ROUND_TRIP)),
            ("fill_drain", lambda: bench_fill_drain(vs, args, geometry)),
            ("churn_event", lambda: bench_churn(vs, args, geometry)),
        ]
        for name, case in cases:
            before = _waits(bridge)
            t0 = time.perf_counter()
            results[name] = case()
            if progress is not None:
                ci = interval_of(results[name])
                progress(
                    f"bench sglang: {name}: {ci.n} rounds in {time.perf_counter() - t0:.0f} s, "
                    f"bridged/native {ci.median:.3f}x [{ci.low:.3f}, {ci.high:.3f}]"
                )
            after = _waits(bridge)
            if before is not None and after is not None:
                waits_by_case[name] = after - before
        results["churn"] = {
            k: v
            for k, v in results["churn_event"].items()
            if k not in ("native", "control", "bridged", "paired")
        }
        for k in list(results["churn"]):
            del results["churn_event"][k]
        stats = bridge.stats()
        waits = stats.get(COUNTER_DRIVER_WAITS)
        results["driver_waits"] = None if waits is None else int(waits)
        results["driver_waits_by_case"] = waits_by_case
        results["bridge_stats"] = {k: int(x) for k, x in stats.items()}
    return results


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """Everything alive now (SGLang, torch, the engines: half a million objects) moved out
    of the collector's sight (`gc.freeze`), so that the collection before each engine's
    round (which keeps collector pauses out of the timed rounds) costs microseconds, not
    the second a full collection takes here. Unfrozen afterwards."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _waits(bridge: Any) -> int | None:
    waits = bridge.stats().get(COUNTER_DRIVER_WAITS)
    return None if waits is None else int(waits)
