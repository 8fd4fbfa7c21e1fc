"""`kvledger bench sglang --part serving`: SGLang's own DeepSeek-V4 allocator, native and bridged,
inside an overlap-scheduled serving loop with a forward stand-in on the device.

The loop is SGLang 0.5.23's `Scheduler.event_loop_overlap`, cut down to what the KV pool sees
(`ServingLoop.step`):

    prepare batch N     admissions (`alloc_extend`, a shared prefix's ids copied from the
                        request holding it), SWA window eviction of the running requests
                        (one free group, as `maybe_evict_swa`), one decode token each
                        (`alloc_decode`); host tensors go to the device as SGLang sends them
                        (pinned, `non_blocking=True`)
    launch forward N    queued on the forward stream (`forward_stream.wait_stream(schedule)`),
                        then `schedule_stream.wait_stream(forward_stream)`: SGLang's coarse
                        WAR barrier, so everything the scheduler queues afterwards (the
                        bridge's id reads and fences included) is behind forward N
    process N-1         the loop's own wait for forward N-1 (`copy_done.synchronize()` in
                        SGLang: timed as `loop_wait`, not as host work), then the finished
                        requests freed (`free_kv_row_segments`) and, with `--serving-compact
                        step`, one step of the production compaction policy
                        (`compact_policy`); with no batch to run, `on_idle`: a compaction step

So step N+1's host work runs while forward N runs. The forward stand-in: on CUDA
`torch.cuda._sleep` calibrated to F ms on a stream of its own and the scheduler on another
(SGLang's `schedule_stream`); on the host backend (`--device cpu`) a worker thread that
sleeps F ms per queued forward, releasing the GIL (`HostDevice`), and the bridge's id reader
replaced by `ModelReader`, which gives its reads and fences CUDA's ordering behind the
forward: a read is there once the forwards launched before it are done; a wait for one
before that blocks until they are (and is counted).

The trace (`TraceSpec`, named `lognormal-chat`): Poisson arrivals at `rate` requests per step
(arrivals counted in steps, not seconds, so every variant runs the same batches step by
step and generates the same tokens); prompt and output lengths log-normal (median
`prompt_median`, sigma `prompt_sigma`; median `output_median`, sigma `output_sigma`), clipped;
with probability `prefix_share` a request starts with one of `prefix_groups` shared
prefixes of `prefix_pages` x 1..groups pages (page-aligned, as SGLang's radix matches are;
held for the whole trace by a request standing in for the radix cache, so the sharer
allocates only its own tokens and protects the prefix: `cache_protected_len`).

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
import hashlib
import math
import queue
import random
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvledger.engines.sglang.bridge.compact_policy import CompactionPolicy
from kvledger.tools.bench import bootstrap
from kvledger.tools.bench.sglang_engine import PAGE, WINDOW, Engine, Request, Shape, published
from kvledger.tools.bench.sglang_memory import SwaMemory

TRACE_NAME = "lognormal-chat"
# The forward times the GPU run spans (ms): see docs/benchmarks.md, "serving loop".
FORWARD_MS = (5.0, 15.0, 40.0)


# -- the trace ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceSpec:
    """`lognormal-chat`: see the module docstring. Lengths in tokens, `rate` in arrivals per
    scheduler step."""

    steps: int
    rate: float = 0.3
    prompt_median: float = 1024.0
    prompt_sigma: float = 1.0
    prompt_min: int = 32
    prompt_max: int = 8192
    output_median: float = 128.0
    output_sigma: float = 0.8
    output_min: int = 4
    output_max: int = 1024
    prefix_share: float = 0.5
    prefix_groups: int = 4
    prefix_pages: int = 2
    seed: int = 13

    def describe(self) -> str:
        return (
            f"{TRACE_NAME}: Poisson arrivals, {self.rate:g} a step; prompt log-normal "
            f"(median {self.prompt_median:g}, sigma {self.prompt_sigma:g}, "
            f"{self.prompt_min}..{self.prompt_max}); output log-normal (median "
            f"{self.output_median:g}, sigma {self.output_sigma:g}, {self.output_min}.."
            f"{self.output_max}); {self.prefix_share:.0%} share one of {self.prefix_groups} "
            f"prefixes of {self.prefix_pages}..{self.prefix_pages * self.prefix_groups} pages; "
            f"seed {self.seed}"
        )


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival: int  # the step it arrives at
    prompt: int  # tokens, the shared prefix included
    output: int
    group: int  # the shared prefix (-1: none)


def prefix_tokens(spec: TraceSpec, group: int) -> int:
    return (group + 1) * spec.prefix_pages * PAGE


def make_trace(spec: TraceSpec) -> list[TraceRequest]:
    """The requests arriving over `spec.steps` steps, in arrival order (same seed, same trace)."""
    rng = random.Random(spec.seed)
    out: list[TraceRequest] = []
    t = 0.0
    while True:
        t += rng.expovariate(spec.rate)
        if t >= spec.steps:
            return out
        group = -1
        if rng.random() < spec.prefix_share:
            group = rng.randrange(spec.prefix_groups)
        own = rng.lognormvariate(math.log(spec.prompt_median), spec.prompt_sigma)
        own = min(spec.prompt_max, max(spec.prompt_min, round(own)))
        prompt = own + (prefix_tokens(spec, group) if group >= 0 else 0)
        output = rng.lognormvariate(math.log(spec.output_median), spec.output_sigma)
        output = min(spec.output_max, max(spec.output_min, round(output)))
        out.append(TraceRequest(len(out), int(t), prompt, output, group))


# -- the device: host stand-in ---------------------------------------------------------------------
class HostDevice:
    """A forward stream on the host: each launched forward runs `seconds` on a worker thread
    (a sleep: the GIL released, as a GPU forward leaves the CPU to the scheduler), in launch
    order. `done(n)`: forward `n` (1-based, in launch order) has run. A forward launched with
    `seconds=None` runs until `release()` (or until a wait for it releases it: the proof's
    forward, as long as the path it overlaps)."""

    def __init__(self) -> None:
        self._gate = threading.Event()
        self.launched = 0
        self._done = 0
        self._cond = threading.Condition()
        self._queue: queue.SimpleQueue[tuple[int, float | None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvledger-forward", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            n, seconds = item
            if seconds is None:
                self._gate.wait()
                self._gate.clear()
            elif seconds > 0:
                time.sleep(seconds)
            with self._cond:
                self._done = n
                self._cond.notify_all()

    def launch(self, seconds: float | None) -> int:
        self.launched += 1
        self._queue.put((self.launched, seconds))
        return self.launched

    def release(self) -> None:
        """End a forward launched with `seconds=None`."""
        self._gate.set()

    def done(self, n: int) -> bool:
        return self._done >= n

    def wait(self, n: int) -> None:
        self.release()
        with self._cond:
            while self._done < n:
                self._cond.wait()

    def close(self) -> None:
        self.release()
        self._queue.put(None)
        self._thread.join(timeout=5)


class WaitLog:
    """Waits made on the scheduler's thread (`owner`) and on other threads, and the seconds
    the scheduler's blocked."""

    def __init__(self) -> None:
        self.owner: int | None = None
        self.waits = 0
        self.blocked_s = 0.0
        self.other_waits = 0
        self.kinds: dict[str, int] = {}

    def record(self, kind: str, seconds: float) -> None:
        if threading.get_ident() == self.owner:
            self.waits += 1
            self.blocked_s += seconds
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
        else:
            self.other_waits += 1


class _ModelRead:
    __slots__ = ("_mark", "_read", "_reader")

    def __init__(self, read: Any, reader: ModelReader, mark: int) -> None:
        self._read, self._reader, self._mark = read, reader, mark

    def ready(self) -> bool:
        return self._reader.device.done(self._mark)

    def lists(self) -> list[list[int]]:
        if not self.ready():
            self._reader.block("read", self._mark)
        return self._read.lists()


class _ModelFence:
    __slots__ = ("_kind", "_mark", "_reader")

    def __init__(self, reader: ModelReader, mark: int, kind: str) -> None:
        self._reader, self._mark, self._kind = reader, mark, kind

    def done(self) -> bool:
        return self._reader.device.done(self._mark)

    def wait(self) -> None:
        if not self.done():
            self._reader.block(self._kind, self._mark)


class ModelReader:
    """The bridge's id reader on the host backend with CUDA's ordering: what the scheduler
    queues after launching forward N (SGLang's WAR barrier) lands once N has run. A read or
    a fence waited for before that blocks until then, and `log` counts it (by thread)."""

    def __init__(self, device: HostDevice, log: WaitLog | None = None) -> None:
        from kvledger.engines.sglang.bridge.readback import HostReader

        self.device = device
        self.log = log or WaitLog()
        self._host = HostReader()
        self.waits = 0  # reads that waited (the CudaReader counter Bridge.stats() reports)

    def block(self, kind: str, mark: int) -> None:
        t0 = time.perf_counter()
        if kind == "read":
            self.waits += 1
        self.device.wait(mark)
        self.log.record(kind, time.perf_counter() - t0)

    def read_many(self, items: list[tuple[Any, int | None]]) -> _ModelRead:
        return _ModelRead(self._host.read_many(items), self, self.device.launched)

    def fence_now(self) -> _ModelFence:
        return _ModelFence(self, self.device.launched, "device fence")

    def stream_fence(self) -> _ModelFence:
        return _ModelFence(self, self.device.launched, "stream fence")


def model_reader(bridge: Any, device: HostDevice, log: WaitLog | None = None) -> ModelReader:
    """Give a host-backend bridge `ModelReader` (its policy's and journal's reader)."""
    reader = ModelReader(device, log)
    bridge.policy.reader = reader
    bridge.policy.journal.reader = reader
    return reader


# -- the device: CUDA ----------------------------------------------------------------------------
class CudaDevice:
    """A forward stream and a schedule stream on CUDA; forwards are `torch.cuda._sleep`
    calibrated to the seconds asked. `sched` is the stream the scheduler's work runs on."""

    def __init__(self, device: str) -> None:
        import torch

        self._torch = torch
        self.forward = torch.cuda.Stream(device)
        self.sched = torch.cuda.Stream(device)
        self.launched = 0
        self._events: dict[int, Any] = {}
        self.cycles_per_s = self._calibrate()

    def _calibrate(self) -> float:
        torch = self._torch
        torch.cuda._sleep(1000)  # warm
        torch.cuda.synchronize()
        cycles = 20_000_000
        best = math.inf
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(cycles)
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) / 1000)
        return cycles / best

    def launch(self, seconds: float) -> int:
        torch = self._torch
        self.forward.wait_stream(self.sched)
        with torch.cuda.stream(self.forward):
            if seconds > 0:
                torch.cuda._sleep(int(seconds * self.cycles_per_s))
            ev = torch.cuda.Event()
            ev.record(self.forward)
        self.sched.wait_stream(self.forward)  # SGLang's coarse WAR barrier
        self.launched += 1
        self._events[self.launched] = ev
        return self.launched

    def done(self, n: int) -> bool:
        ev = self._events.get(n)
        return ev is None or bool(ev.query())

    def wait(self, n: int) -> None:
        ev = self._events.pop(n, None)
        if ev is not None:
            ev.synchronize()

    def close(self) -> None:
        self._torch.cuda.synchronize()


class CudaSyncWatch:
    """Counts and times the scheduler thread's waits on CUDA inside `window()`: every
    synchronisation torch's sync debug mode reports (as a warning) and every
    `torch.cuda.Event.synchronize` / `torch.cuda.Stream.synchronize` (which it does not
    report), the latter timed; a window with a debug-mode report is charged whole."""

    def __init__(self, log: WaitLog) -> None:
        import torch

        self._torch = torch
        self.log = log
        self._inside = False
        self._records: list[Any] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        torch = self._torch
        ev_sync = torch.cuda.Event.synchronize
        st_sync = torch.cuda.Stream.synchronize
        watch = self

        def timed(kind: str, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
            def wrapper(self: Any) -> Any:
                if not watch._inside:
                    return fn(self)
                before = len(watch._records)
                t0 = time.perf_counter()
                try:
                    return fn(self)
                finally:
                    if len(watch._records) == before:  # not reported by debug mode already
                        watch.log.record(kind, time.perf_counter() - t0)

            return wrapper

        _cls(torch.cuda.Event).synchronize = timed("event synchronize", ev_sync)
        _cls(torch.cuda.Stream).synchronize = timed("stream synchronize", st_sync)
        mode = torch.cuda.get_sync_debug_mode()
        records = self._records

        def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            # The debug mode is process-wide: only the scheduler thread's reports count (the
            # mapper's fence waits are its own business, off that thread).
            if threading.get_ident() == watch.log.owner:
                records.append(str(message))

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                torch.cuda.set_sync_debug_mode("warn")
                yield
        finally:
            torch.cuda.set_sync_debug_mode(mode)
            _cls(torch.cuda.Event).synchronize = ev_sync
            _cls(torch.cuda.Stream).synchronize = st_sync

    @contextlib.contextmanager
    def window(self, kind: str) -> Iterator[None]:
        before = len(self._records)
        self._inside = True
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._inside = False
            reported = len(self._records) - before
            if reported:
                seconds = time.perf_counter() - t0
                for _ in range(reported):
                    self.log.record(f"{kind}: implicit", seconds / reported)
                del self._records[before:]


# -- the engine as the serving loop drives it ----------------------------------------------------
@dataclass
class Live:
    """A running request: SGLang's request stand-in, its trace entry, its shared prefix."""

    req: Request
    trace: TraceRequest
    prefix: int  # tokens protected (the shared prefix), 0 without one


class ServingEngine(Engine):
    """`Engine` with the host-to-device copies SGLang's scheduler makes (pinned host tensors,
    `non_blocking=True`: no synchronisation), admissions behind a shared prefix, and decode,
    eviction and finish of a given set of requests."""

    def __init__(self, shape: Shape, device: str = "cpu") -> None:
        super().__init__(shape, device)
        self._pin = device != "cpu"
        self.holders: dict[int, Request] = {}  # prefix group -> the request holding it

    def _to_dev(self, t: Any) -> Any:
        if not self._pin:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def admit(self, n: int, prefix: tuple[Request, int] | None = None) -> Request | None:
        """A request of `n` tokens, the first `prefix[1]` of them `prefix[0]`'s (their ids
        copied, as a radix match gives them); None when SGLang has no room for it."""
        torch = self._torch
        req = Request()
        if self.r2t.alloc([req]) is None:
            return None
        shared = 0 if prefix is None else prefix[1]
        idx = req.kv.req_pool_idx
        if prefix is not None:
            src = prefix[0].kv.req_pool_idx
            self.r2t.req_to_token[idx, :shared] = self.r2t.req_to_token[src, :shared]
            last = self.r2t.req_to_token[src, shared - 1 : shared].long()
        else:
            last = self._to_dev(torch.tensor([-1], dtype=torch.int64))
        pre_cpu = torch.tensor([shared], dtype=torch.int64)
        lens_cpu = torch.tensor([n], dtype=torch.int64)
        out = self.allocator.alloc_extend(
            self._to_dev(pre_cpu), pre_cpu, self._to_dev(lens_cpu), lens_cpu, last, n - shared
        )
        if out is None:
            self.r2t.free(req)
            return None
        self.r2t.write((idx, slice(shared, n)), out)
        req.seq_len = n
        req.kv.kv_allocated_len = n
        req.kv.cache_protected_len = shared
        return req

    def decode_some(self, reqs: list[Request]) -> None:
        torch = self._torch
        if not reqs:
            return
        idx = self._to_dev(torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64))
        pos_cpu = torch.tensor([r.seq_len for r in reqs], dtype=torch.int64)
        pos = self._to_dev(pos_cpu)
        last = self.r2t.req_to_token[idx, pos - 1].long()
        lens_cpu = pos_cpu + 1
        out = self.allocator.alloc_decode(self._to_dev(lens_cpu), lens_cpu, last)
        if out is None:
            raise RuntimeError("decode: SGLang's allocator is out of pages")
        self.r2t.req_to_token[idx, pos] = out.to(torch.int32)
        for r in reqs:
            r.seq_len += 1
            r.decoded += 1
            r.kv.kv_allocated_len = r.seq_len

    def release(self, req: Request) -> None:
        """Free what `req` holds beyond its protected prefix, and its request slot."""
        shared = req.kv.cache_protected_len
        row = self.r2t.req_to_token[req.kv.req_pool_idx, shared : req.seq_len].long()
        evicted = req.kv.get_evicted_seqlen(self._swa_component)
        self._free_rows(
            self.allocator, [(row, shared)], swa_evicted_seqlen=evicted, swa_dead_lo=shared
        )
        self.r2t.free(req)


# -- the loop ------------------------------------------------------------------------------------
@dataclass
class StepTimes:
    host: list[float] = field(default_factory=list)  # prepare + process, the loop's wait excluded
    blocked: list[float] = field(
        default_factory=list
    )  # inside the host work, waiting on the device
    waits: list[int] = field(default_factory=list)
    loop_wait: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)


class ServingLoop:
    """One variant (native or bridged) running the trace: `run(steps)` runs that many steps of
    the overlap loop and drains it (the last batch's result processed)."""

    def __init__(
        self,
        name: str,
        engine: ServingEngine,
        trace: list[TraceRequest],
        spec: TraceSpec,
        device: Any,
        forward_s: float,
        *,
        max_running: int,
        prefill_tokens: int,
        policy: CompactionPolicy | None = None,
        compact_at: str = "step",
        watch: Any = None,
        log: WaitLog | None = None,
        bridge: Any = None,
    ) -> None:
        self.name = name
        self.e = engine
        self.trace = trace
        self.spec = spec
        self.device = device
        self.forward_s = forward_s
        self.max_running = max_running
        self.prefill_tokens = prefill_tokens
        self.policy = policy
        self.compact_at = compact_at
        self.watch = watch
        self.log = log or WaitLog()
        self.bridge = bridge
        self.step_no = 0
        self.next_arrival = 0
        self.waiting: list[TraceRequest] = []
        self.running: list[Live] = []
        self.done_pending: list[Live] = []  # decoded their last token in the batch in flight
        self.last_batch: int | None = None  # the forward in flight whose result is pending
        self.tokens = 0
        self.finished = 0
        self.compactions = 0
        self.rows_moved = 0
        self.idle_steps = 0
        self.digest = hashlib.sha256()
        self.times = StepTimes()

    # -- SGLang's scheduler, cut down ----------------------------------------------------------
    def hold_prefixes(self) -> None:
        """The shared prefixes, held for the whole trace (the radix cache's stand-in)."""
        e = self.e
        for g in range(self.spec.prefix_groups):
            n = prefix_tokens(self.spec, g)
            req = e.admit(n)
            if req is None:
                raise RuntimeError(f"no room for shared prefix {g} ({n} tokens)")
            e.holders[g] = req
            e.evict_windows([req])

    def _window(self, kind: str) -> Any:
        return self.watch.window(kind) if self.watch is not None else contextlib.nullcontext()

    def _prepare(self) -> int:
        """Admissions, window eviction, a decode token each: SGLang's get_next_batch_to_run.
        Returns the tokens of the batch (0: nothing to run)."""
        e, spec = self.e, self.spec
        while (
            self.next_arrival < len(self.trace)
            and self.trace[self.next_arrival].arrival <= self.step_no
        ):
            self.waiting.append(self.trace[self.next_arrival])
            self.next_arrival += 1
        admitted: list[Live] = []
        budget = self.prefill_tokens
        swa_free = e.swa.available_size()
        full_free = e.allocator.full_available_size()
        reserve = (len(self.running) + 1) * PAGE  # a page a running request may need to decode
        while self.waiting and len(self.running) + len(admitted) < self.max_running:
            t = self.waiting[0]
            shared = prefix_tokens(spec, t.group) if t.group >= 0 else 0
            own = t.prompt - shared
            need = -(-own // PAGE) * PAGE + PAGE
            if own > budget and admitted:
                break
            if need + reserve > swa_free or need + reserve > full_free:
                break
            prefix = (e.holders[t.group], shared) if t.group >= 0 else None
            req = e.admit(t.prompt, prefix)
            if req is None:
                break
            self.waiting.pop(0)
            admitted.append(Live(req, t, shared))
            budget -= own
            swa_free -= need
            full_free -= need
            reserve += PAGE
        decoding = [x for x in self.running if x.req.decoded < x.trace.output]
        e.evict_windows([x.req for x in decoding])
        e.decode_some([x.req for x in decoding])
        for x in decoding:
            if x.req.decoded >= x.trace.output:
                self.done_pending.append(x)
        self.running.extend(admitted)
        tokens = len(decoding) + len(admitted)
        self.digest.update(
            f"{self.step_no}:{[x.trace.index for x in admitted]}:{len(decoding)};".encode()
        )
        return tokens

    def _process(self) -> None:
        """The last batch's result: the finished requests freed; a compaction step."""
        if self.done_pending:
            done, self.done_pending = self.done_pending, []
            for x in done:
                self.e.release(x.req)
                self.running.remove(x)
                self.finished += 1
            self.digest.update(f"f{sorted(x.trace.index for x in done)};".encode())
        if self.compact_at == "step":
            self._compact()

    def _compact(self) -> None:
        if self.policy is not None and self.bridge is not None:
            moved = self.policy.step(self.bridge)
            if moved:
                self.compactions += 1
                self.rows_moved += moved

    def step(self) -> None:
        t0 = time.perf_counter()
        log = self.log
        w0, b0 = log.waits, log.blocked_s
        with self._window("prepare"):
            tokens = self._prepare()
        t1 = time.perf_counter()
        batch = self.device.launch(self.forward_s) if tokens else None
        t2 = time.perf_counter()
        loop_wait = 0.0
        if self.last_batch is not None:
            self.device.wait(self.last_batch)
            loop_wait = time.perf_counter() - t2
        t3 = time.perf_counter()
        with self._window("process"):
            if self.last_batch is not None:
                self._process()
            elif batch is None:  # on_idle: no batch in flight
                self.idle_steps += 1
                self._compact()
        t4 = time.perf_counter()
        self.last_batch = batch
        self.tokens += tokens
        self.step_no += 1
        tm = self.times
        tm.host.append((t1 - t0) + (t4 - t3))
        tm.blocked.append(log.blocked_s - b0)
        tm.waits.append(log.waits - w0)
        tm.loop_wait.append(loop_wait)
        tm.wall.append(t4 - t0)

    def drain(self) -> None:
        """The batch in flight waited for and its result processed (between rounds)."""
        if self.last_batch is not None:
            self.device.wait(self.last_batch)
            self.last_batch = None
            self._process()

    def run(self, steps: int, after_step: Callable[[], None] | None = None) -> tuple[float, int]:
        """`steps` steps and the drain; returns (seconds, tokens)."""
        tok0 = self.tokens
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
            if after_step is not None:
                after_step()
        self.drain()
        return time.perf_counter() - t0, self.tokens - tok0

    def finish_all(self) -> None:
        self.drain()
        for x in self.running:
            self.e.release(x.req)
        self.running.clear()
        self.done_pending.clear()


# -- the bench -----------------------------------------------------------------------------------
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

    from accounting.buffers import Owner
    from accounting.ledger import Ledger
    from kvledger.engines.sglang.bridge import ENV_ENABLE, attach
    from kvledger.tools.bench.sglang_cases import churn_bound

    rounds, per_round = args.serving_rounds, args.serving_steps
    spec = TraceSpec(
        steps=rounds * per_round,
        rate=args.serving_rate,
        prompt_median=args.serving_prompt_median,
        output_median=args.serving_output_median,
        prompt_max=args.serving_prompt_max,
        output_max=args.serving_output_max,
        seed=args.seed,
    )
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
        ledger = Ledger({"model_name": "kvledger-bench-sglang-serving"})
        pool_options = (
            {} if args.max_spare_pages is None else {"max_spare_pages": args.max_spare_pages}
        )
        bridge: Any = attach(
            bridged_e.pool,
            ledger,
            allocator=bridged_e.allocator,
            env={ENV_ENABLE: "1"},
            require=True,
            pool_options=pool_options,
        )
        stack.callback(bridge.detach)
        logs = {"native": WaitLog(), "bridged": WaitLog()}
        for lg in logs.values():
            lg.owner = threading.get_ident()
        if not cuda:
            model_reader(bridge, device, logs["bridged"])
        watch = CudaSyncWatch(logs["native"]) if cuda else None
        fwd = forward_ms / 1000
        loops = {
            "native": ServingLoop(
                "native", native_e, trace, spec, device, fwd,
                max_running=args.serving_max_running, prefill_tokens=args.serving_prefill_tokens,
                watch=watch, log=logs["native"],
            ),
            "bridged": ServingLoop(
                "bridged", bridged_e, trace, spec, device, fwd,
                max_running=args.serving_max_running, prefill_tokens=args.serving_prefill_tokens,
                policy=policy, compact_at=args.serving_compact, watch=watch,
                log=logs["bridged"], bridge=bridge,
            ),
        }  # fmt: skip
        for lp in loops.values():
            lp.hold_prefixes()
        bridge.wait_idle()
        account = next(
            a for a in ledger.accounts() if a.family == "swa_kv" and a.owner is Owner.VMM
        )
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
        times: dict[str, list[float]] = {"native": [], "bridged": []}
        toks: dict[str, list[int]] = {"native": [], "bridged": []}
        order = ("native", "bridged")
        with watch.installed() if watch is not None else contextlib.nullcontext():
            for i in range(rounds):
                for k in order if i % 2 == 0 else order[::-1]:
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
            }
        b, n = loops["bridged"], loops["native"]
        out["paired"] = {
            "tokens_per_s": _paired(
                [t / s for t, s in zip(toks["bridged"], times["bridged"], strict=True)],
                [t / s for t, s in zip(toks["native"], times["native"], strict=True)],
            ),
            "steps_per_s": _paired(times["native"], times["bridged"]),
        }
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
        for lp in (n, b):
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
            "trace": TraceSpec(
                steps=args.serving_rounds * args.serving_steps,
                rate=args.serving_rate,
                prompt_median=args.serving_prompt_median,
                output_median=args.serving_output_median,
                prompt_max=args.serving_prompt_max,
                output_max=args.serving_output_max,
                seed=args.seed,
            ).describe(),
            "layers": args.layers,
            "swa_pages": args.serving_swa_pages,
            "max_running": args.serving_max_running,
            "prefill_tokens": args.serving_prefill_tokens,
            "rounds": args.serving_rounds,
            "steps_per_round": args.serving_steps,
            "compact_at": args.serving_compact,
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
            f"requests finished; same tokens native/bridged: {run['same_tokens']}"
        )
        out.append(
            f"    tokens/s bridged/native {t['median']:.4f}x [{t['low']:.4f}, {t['high']:.4f}]; "
            f"steps/s {s['median']:.4f}x [{s['low']:.4f}, {s['high']:.4f}]; native "
            f"{nat['tokens_per_s']:.0f} tokens/s, {nat['steps_per_s']:.1f} steps/s"
        )
        for k, v in (("native", nat), ("bridged", br)):
            out.append(
                f"    {k:8s} host work/step median {v['host_us']['median']:.0f} us, p99 "
                f"{v['host_us']['p99']:.0f}, max {v['host_us']['max']:.0f}; blocked on the device "
                f"median {v['blocked_us']['median']:.1f} us, mean {v['blocked_us']['mean']:.1f}, "
                f"max {v['blocked_us']['max']:.0f}; waits/1000 steps {v['waits_per_1000_steps']:.1f} "
                f"{v['wait_kinds'] or ''}; loop wait median {v['loop_wait_ms']:.2f} ms"
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


# -- the no-synchronisation proof -----------------------------------------------------------------
PROOF_PATHS = ("alloc", "decode", "window eviction", "free", "compaction", "detach")


@contextlib.contextmanager
def _strict(cuda: bool, log: WaitLog) -> Iterator[None]:
    """CUDA: torch's sync debug mode 'error' and `Event`/`Stream.synchronize` raising too (the
    debug mode does not see them), on `log.owner`'s thread. The debug mode is process-wide:
    the background mapper's fence waits raise too while a path runs (the mapper logs and
    retries them; nothing of the path's result depends on it). Host: nothing (the waits go to
    `log`)."""
    if not cuda:
        yield
        return
    import torch

    ev, st = torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize

    def refuse(kind: str, fn: Callable[[Any], None]) -> Callable[[Any], None]:
        def wrapper(self: Any) -> None:
            if threading.get_ident() == log.owner:
                raise RuntimeError(f"{kind} on the scheduler thread")
            fn(self)

        return wrapper

    _cls(torch.cuda.Event).synchronize = refuse("torch.cuda.Event.synchronize", ev)
    _cls(torch.cuda.Stream).synchronize = refuse("torch.cuda.Stream.synchronize", st)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
        _cls(torch.cuda.Event).synchronize = ev
        _cls(torch.cuda.Stream).synchronize = st


def _proof_one(name: str, shape: Shape, device: str, dev: Any, forward_ms: float) -> dict[str, str]:
    """The proof's paths on one engine (`name`: native or bridged)."""
    import torch

    from accounting.ledger import Ledger
    from kvledger.engines.sglang.bridge import ENV_ENABLE, attach

    cuda = device.startswith("cuda")
    e = ServingEngine(shape, device)
    log = WaitLog()
    log.owner = threading.get_ident()
    bridge = None
    if name == "bridged":
        bridge = attach(
            e.pool, Ledger({}), allocator=e.allocator, env={ENV_ENABLE: "1"}, require=True
        )
        if not cuda:
            model_reader(bridge, dev, log)
    reqs: list[Request] = []
    policy = CompactionPolicy()
    res: dict[str, str] = {}
    failed = False

    def admit() -> None:
        for _ in range(120):
            r = e.admit(200)
            assert r is not None
            reqs.append(r)

    def decode() -> None:
        for _ in range(3):
            e.decode_some(reqs)

    def evict() -> None:
        for r in reqs:
            r.seq_len += 0
        e.evict_windows(reqs)

    def free() -> None:
        for r in reqs[::3] + reqs[1::3]:
            e.release(r)
        del reqs[:]

    def compaction() -> None:
        if bridge is None:
            raise _NotApplicable
        if policy.step(bridge) == 0:
            raise RuntimeError("compaction: the policy moved no row (not due)")

    def detach() -> None:
        if bridge is None:
            raise _NotApplicable
        bridge.detach()

    paths = dict(zip(PROOF_PATHS, (admit, decode, evict, free, compaction, detach), strict=True))
    for path, fn in paths.items():
        if cuda:
            torch.cuda.synchronize()
        elif bridge is not None:
            bridge.wait_idle()
        # the forward in flight (host: until the path is done, or waited for)
        dev.launch(forward_ms / 1000 if cuda else None)
        w0 = log.waits
        try:
            with _strict(cuda, log):
                fn()
            got = "ok" if log.waits == w0 else f"{log.waits - w0} waits ({dict(log.kinds)})"
        except _NotApplicable:
            got = "n/a"
        except Exception as ex:
            got = f"raised {type(ex).__name__}: {str(ex).splitlines()[0][:160]}"
            failed = True
        if failed and got != "n/a" and not got.startswith("raised"):
            got += " (after an earlier path raised)"
        res[path] = got
        log.kinds.clear()
        dev.wait(dev.launched)  # (host: releases the held forward)
    if bridge is not None:
        bridge.detach()
    return res


def sync_proof(device: str = "cpu", forward_ms: float = 20.0) -> dict[str, dict[str, str]]:
    """Every path of the bridged engine (and of a native one, the control) run on the
    scheduler's stream with a forward in flight on the forward stream. CUDA: under
    `torch.cuda.set_sync_debug_mode('error')` (and Event/Stream.synchronize refused): "ok" or
    the error. Host: the waits `ModelReader` counted ("ok" when none). Each path runs on
    state the paths before it left; one that raised may leave the next on odd state (said)."""
    import torch

    cuda = device.startswith("cuda")
    shape = Shape(layers=4, swa_pages=256, full_pages=1024, requests=130, max_context=4096)
    out: dict[str, dict[str, str]] = {}
    with published(), contextlib.ExitStack() as stack:
        dev: Any = CudaDevice(device) if cuda else HostDevice()
        stack.callback(dev.close)
        if cuda:
            stack.enter_context(torch.cuda.stream(dev.sched))
        for name in ("native", "bridged"):
            out[name] = _proof_one(name, shape, device, dev, forward_ms)
    return out


def _cls(c: Any) -> Any:
    """A torch class whose method is swapped for the time of a measurement (untyped here)."""
    return c


class _NotApplicable(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    """`python -m kvledger.tools.bench.sglang_serving proof [--device cuda]`: the proof's table."""
    import argparse
    import json

    warnings.filterwarnings("ignore", category=UserWarning)
    p = argparse.ArgumentParser(prog="python -m kvledger.tools.bench.sglang_serving")
    p.add_argument("what", choices=("proof",))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--forward-ms", type=float, default=20.0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    dev = "cuda:0" if a.device == "cuda" else "cpu"
    r = sync_proof(dev, a.forward_ms)
    mode = (
        f"sync debug mode 'error', a {a.forward_ms:g} ms forward in flight"
        if a.device == "cuda"
        else "host model of CUDA's order, a forward in flight until the path ends"
    )
    print(f"no-synchronisation proof on {dev} ({mode}):")
    for path in PROOF_PATHS:
        print(f"  {path:16s} native: {r['native'][path]:40s} bridged: {r['bridged'][path]}")
    if a.json:
        print(json.dumps(r, indent=2))
    bad = [p for p in PROOF_PATHS if r["bridged"][p] not in ("ok", "n/a")]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
