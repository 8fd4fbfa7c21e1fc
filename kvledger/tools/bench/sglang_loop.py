"""The serving loop of `kvledger bench sglang --part serving`: SGLang 0.5.23's
`Scheduler.event_loop_overlap`, cut down to what the KV pool sees (`ServingLoop.step`):

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

So step N+1's host work runs while forward N runs (the forward stand-ins:
`sglang_forward`). Per step the loop keeps the scheduler thread's host work (prepare +
process, the loop's wait excluded), the waits inside it and the time they blocked
(`sglang_waits`), the loop's wait and the step's wall time; with a `GcClock`, the garbage
collections inside the step, and where each step lies (round, step), so the slowest steps
can be named (`StepTimes.slowest`).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvledger.engines.sglang.bridge.compact_policy import CompactionPolicy
from kvledger.gc_clock import GcClock
from kvledger.tools.bench.sglang_engine import PAGE, Engine, Request, Shape
from kvledger.tools.bench.sglang_trace import TraceRequest, TraceSpec, prefix_tokens
from kvledger.tools.bench.sglang_waits import WaitLog


@dataclass
class Live:
    """A running request: SGLang's request stand-in, its trace entry, its shared prefix."""

    req: Request
    trace: TraceRequest
    prefix: int  # tokens protected (the shared prefix), 0 without one


class ServingEngine(Engine):
    """`Engine` with the host-to-device copies SGLang's scheduler makes (pinned host tensors,
    `non_blocking=True`: no synchronisation), admissions behind a shared prefix, and decode
    (`Engine.decode_some`), eviction and finish of a given set of requests."""

    def __init__(self, shape: Shape, device: str = "cpu") -> None:
        super().__init__(shape, device)
        self._pin = device != "cpu"
        self.holders: dict[int, Request] = {}  # prefix group -> the request holding it

    def _to_dev(self, t: Any) -> Any:
        """As SGLang sends a host tensor: pinned, `non_blocking=True` (`decode_some` too)."""
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
    prepare: list[float] = field(default_factory=list)  # the host work's two parts
    process: list[float] = field(default_factory=list)
    gc: list[float] = field(default_factory=list)  # collections in the step (its wait too)
    compacted: list[bool] = field(default_factory=list)  # a compaction step moved rows
    where: list[tuple[int, int]] = field(default_factory=list)  # (round, step in round)

    def slowest(self, n: int = 3) -> list[dict[str, Any]]:
        """The `n` steps of most host work, each with what it was made of (ms)."""
        order = sorted(range(len(self.host)), key=self.host.__getitem__, reverse=True)[:n]
        return [
            {
                "round": self.where[i][0],
                "step": self.where[i][1],
                "host_ms": self.host[i] * 1e3,
                "prepare_ms": self.prepare[i] * 1e3,
                "process_ms": self.process[i] * 1e3,
                "gc_ms": self.gc[i] * 1e3,
                "blocked_ms": self.blocked[i] * 1e3,
                "waits": self.waits[i],
                "compacted": self.compacted[i],
            }
            for i in order
        ]


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
        gc_clock: GcClock | None = None,
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
        self.gc_clock = gc_clock
        self.round = 0  # set by run(): which round a step's times belong to
        self.round_step = 0
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
        gc0 = self.gc_clock.seconds if self.gc_clock is not None else 0.0
        c0 = self.compactions
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
        tm.prepare.append(t1 - t0)
        tm.process.append(t4 - t3)
        # the collections in the loop's wait are not host work, but read with it: a
        # collection that straddles t2-t3 shows in gc and not in host
        tm.gc.append(self.gc_clock.seconds - gc0 if self.gc_clock is not None else 0.0)
        tm.compacted.append(self.compactions != c0)
        tm.where.append((self.round, self.round_step))
        self.round_step += 1

    def drain(self) -> None:
        """The batch in flight waited for and its result processed (between rounds)."""
        if self.last_batch is not None:
            self.device.wait(self.last_batch)
            self.last_batch = None
            self._process()

    def run(self, steps: int, after_step: Callable[[], None] | None = None) -> tuple[float, int]:
        """`steps` steps and the drain; returns (seconds, tokens)."""
        tok0 = self.tokens
        self.round_step = 0
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
            if after_step is not None:
                after_step()
        self.drain()
        self.round += 1
        return time.perf_counter() - t0, self.tokens - tok0

    def forget_times(self) -> None:
        """Start the record afresh (after warm-up rounds): times and compaction counts."""
        self.times = StepTimes()
        self.compactions = 0
        self.rows_moved = 0
        self.round = 0

    def finish_all(self) -> None:
        self.drain()
        for x in self.running:
            self.e.release(x.req)
        self.running.clear()
        self.done_pending.clear()
