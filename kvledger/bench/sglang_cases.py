"""The cases of `kvledger bench sglang` (see `kvledger.bench.sglang`), native and bridged.

Each timed case runs both variants the same way, in rounds that alternate which
variant goes first. Bridge figures are read through the bridge's public API
(`Bridge.stats()`, `Bridge.backend.granularity`) and the ledger the bench gave
it (the `swa_kv` VMM account's map and unmap totals, in page ids).
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

from accounting.buffers import Owner
from accounting.ledger import Account, Ledger
from accounting.snapfile.publisher import Publisher
from kvledger.bench.sglang_engine import PAGE, WINDOW, Engine, Request, Shape, published
from kvledger.bench.sglang_memory import SwaMemory
from kvledger.sglang.bridge.compact_policy import CompactionPolicy

# The counter of allocations that waited for a driver map (Bridge.stats(), docs/sglang-bridge.md).
COUNTER_DRIVER_WAITS = "waited_allocs"
ROUND_TRIP_TOKENS = 4096
CHURN_LOW, CHURN_HIGH = 0.10, 0.90


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

    def mapped_pages(self) -> int:
        return int(self.bridge.stats()["mapped_pages"]) if self.bridge is not None else 0

    def mapped_spare_physical(self) -> tuple[int, int, int]:
        if self.bridge is None:
            return 0, 0, 0
        stats = self.bridge.stats()
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
    """Ratios paired by round: in each round every engine ran back to back, so the ratio of
    their medians in that round cancels what drifts between rounds (other load, clock
    changes); the median of those ratios over the rounds, with their min and max."""
    out: dict[str, Any] = {"rounds": len(per_round["native"])}
    for name in ("bridged", "control"):
        ratios = [b / n for b, n in zip(per_round[name], per_round["native"], strict=True)]
        out[name] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def _rounds(vs: Variants, rounds: int) -> Iterator[tuple[int, Variant]]:
    """(round, variant), the order rotating round by round (every variant goes first in turn)."""
    for i in range(rounds):
        k = i % len(vs)
        for v in vs[k:] + vs[:k]:
            yield i, v


def bridged_of(vs: Variants) -> Variant:
    return next(v for v in vs if v.bridge is not None)


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
    from kvledger.sglang.bridge import ENV_ENABLE, attach

    shape = shape_for(args)
    device = "cuda:0" if args.device == "cuda" else "cpu"
    with published(), contextlib.ExitStack() as stack:
        native = Variant("native", Engine(shape, device))
        control = Variant("control", Engine(shape, device))
        engine = Engine(shape, device)
        ledger = Ledger({"model_name": "kvledger-bench-sglang"})
        directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvledger-bench-"))
        bridge = attach(
            engine.pool,
            ledger,
            allocator=engine.allocator,
            env={ENV_ENABLE: "1"},
            require=True,
            pool_options={"max_spare_pages": args.max_spare_pages},
        )
        stack.callback(bridge.detach)
        stack.enter_context(Publisher(ledger, directory, interval=1.0, source="bench"))
        account = next(
            a for a in ledger.accounts() if a.family == "swa_kv" and a.owner is Owner.VMM
        )
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
    """A case timed step by step: `warm` once per engine, then in each round `step` timed
    `getattr(args, per_round)` times on each engine in turn."""

    warm: Callable[[Engine, Any], None]
    step: Callable[[Engine, Any], None]
    per_round: str  # the argument giving the steps of one round


DECODE_STEP = TimedCase(warm=ramp_up, step=decode_step, per_round="steps")
ROUND_TRIP = TimedCase(warm=round_trip, step=round_trip, per_round="trips")


def _settle(v: Variant) -> None:
    """After a bridged round, untimed: replay what its hooks recorded, on this thread, so the
    background mapper does not replay it (finding the journal idle) while the next engine's
    round is timed, a cost charged to the wrong engine. Within a round the replays that
    SGLang's calls trigger are timed with the steps they land in (in each case's mean)."""
    if v.bridge is not None:
        v.bridge.flush()


def _timed(fn: Callable[..., None], *args: Any) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def bench_timed(vs: Variants, args: Any, case: TimedCase) -> dict[str, Any]:
    """Each engine's step times, the ratios paired by round, and the bridged engine's maps
    and unmaps over the timed rounds."""
    for v in vs:
        case.warm(v.engine, args)
    times: dict[str, list[float]] = {v.name: [] for v in vs}
    per_round: dict[str, list[float]] = {v.name: [] for v in vs}
    steps = getattr(args, case.per_round)
    bridged = bridged_of(vs)
    m0, u0 = bridged.map_totals()
    for _, v in _rounds(vs, args.rounds):
        gc.collect()
        got = [_timed(case.step, v.engine, args) for _ in range(steps)]
        _settle(v)
        times[v.name] += got
        per_round[v.name].append(statistics.median(got))
    m1, u1 = bridged.map_totals()
    return {
        **{k: summary(t) for k, t in times.items()},
        "paired": paired(per_round),
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
    for v in vs:
        v.engine.finish_all()
        fill_drain(v, args, None)  # warm
    times: dict[str, list[float]] = {v.name: [] for v in vs}
    cycles = []
    for _, v in _rounds(vs, args.cycles):
        gc.collect()
        r = fill_drain(v, args, geometry if v.bridge is not None else None)
        _settle(v)
        times[v.name].append(r.pop("seconds"))
        if r:
            cycles.append(r)
    # one cycle per engine per round: the per-round "medians" are the cycles themselves
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


def bench_churn(vs: Variants, args: Any, geometry: tuple[int, int]) -> dict[str, Any]:
    rb, gran = geometry
    per_round = -(-args.churn_events // args.rounds)
    state = {v.name: Churn(args.seed, args.swa_pages) for v in vs}
    times: dict[str, list[float]] = {v.name: [] for v in vs}
    kinds = {"admit": 0, "finish": 0}
    occ: list[float] = []
    samples: list[tuple[int, int]] = []  # (mapped, bound) after warm-up
    spares: list[int] = []  # spare page ids at each of those samples
    # The production compaction policy, exactly as the plugin runs it (one step per event).
    policy = CompactionPolicy.from_env()
    memory = SwaMemory(row_bytes=rb, layers=args.layers, rows=args.swa_pages)
    for v in vs:
        v.engine.finish_all()
    for _, v in _rounds(vs, args.rounds):
        churn = state[v.name]
        e = v.engine
        gc.collect()
        for _ in range(min(per_round, args.churn_events - churn.done)):
            t0 = time.perf_counter()
            kind = churn.event(e)
            if v.bridge is not None:  # between batches: the bridge may move held rows
                policy.step(v.bridge)
                e.sync()
            times[v.name].append(time.perf_counter() - t0)
            if v.bridge is None:
                continue
            kinds[kind] += 1
            held = e.held_swa_pages()
            occ.append(held / args.swa_pages)
            if churn.done > args.churn_warmup:
                bound = math.ceil((held + 1) * rb / gran) + args.max_spare_pages + 1
                mapped, spare, physical = v.mapped_spare_physical()
                samples.append((mapped, bound))
                spares.append(spare)
                memory.add(physical, held)
    for v in vs:
        v.engine.finish_all()
    excess = [m - b for m, b in samples]
    worst = max(range(len(samples)), key=lambda i: samples[i][0])
    return {
        **{k: summary(t) for k, t in times.items()},
        "rows_moved": int(bridged_of(vs).bridge.stats()["rows_moved"]),
        "compaction": {**policy.stats(), "describe": policy.describe()},
        "swa_memory": memory.result(),
        "events": args.churn_events,
        "admits": kinds["admit"],
        "finishes": kinds["finish"],
        "occupancy_min": min(occ[args.churn_warmup :]),
        "occupancy_max": max(occ[args.churn_warmup :]),
        "warmup": args.churn_warmup,
        "checked": len(samples),
        "over": sum(1 for x in excess if x > 0),
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


def run_all(args: Any, *, threads: int) -> dict[str, Any]:
    import importlib.metadata

    import torch

    from kvledger.sglang.bridge.bridge import DEFAULT_POOL_OPTIONS

    if args.max_spare_pages is None:  # the bridge's own policy
        args.max_spare_pages = int(DEFAULT_POOL_OPTIONS["max_spare_pages"])

    with variants(args) as vs:
        bridge = bridged_of(vs).bridge
        row_bytes = int(bridged_of(vs).engine.pool.swa_kv_pool.kv_buffer[0].shape[1])
        gran = int(bridge.backend.granularity)
        geometry = (row_bytes, gran)
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
            results[name] = case()
            after = _waits(bridge)
            if before is not None and after is not None:
                waits_by_case[name] = after - before
        results["churn"] = {
            k: v
            for k, v in results["churn_event"].items()
            if k not in ("native", "control", "bridged")
        }
        for k in list(results["churn"]):
            del results["churn_event"][k]
        stats = bridge.stats()
        waits = stats.get(COUNTER_DRIVER_WAITS)
        results["driver_waits"] = None if waits is None else int(waits)
        results["driver_waits_by_case"] = waits_by_case
        results["bridge_stats"] = {k: int(x) for k, x in stats.items()}
    return results


def _waits(bridge: Any) -> int | None:
    waits = bridge.stats().get(COUNTER_DRIVER_WAITS)
    return None if waits is None else int(waits)
