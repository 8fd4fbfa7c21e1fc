"""What kvledger's vLLM hooks cost, measured inside the engine core (opt-in; a bench tool).

With `KVLEDGER_VLLM=1` and `KVLEDGER_VLLM_COST=1`, `hooks.install()` hands its patches to
`instrument()`, which rebuilds every kvledger wrapper that runs on the engine's step path
with a timer around it and another around vLLM's own method inside it:
`Scheduler.schedule` and `Scheduler.has_requests` (`hooks`), and the evictable counter's
wrappers on the block pool and its free queue (`occupancy.EvictableCounter`, kvledger code
that runs inside vLLM's own `schedule` and `update_from_output`). It also times the engine
core's whole step (`EngineCore.step` or `EngineCore.step_with_batch_queue`, whichever vLLM
picked: its busy loop binds `step_fn` in `EngineCore.__init__`, after the plugins are
loaded, so the patched method is the one it calls). Per wrapper call, kvledger's time is
the wrapper's total less vLLM's method; it holds the publish/refresh work, the wrapper's own
overhead and the timer's (one extra call frame and two clock reads: `timer_ns` in the file
estimates it per call). So the figure is an upper bound of what kvledger costs on the step
path. Not in it: the publisher's thread (its heartbeat and, for the engine core, the
encode and write of each publish, handed over by `Publisher.submit`: off the step path,
but it takes the GIL now and then); it is timed apart (`publish_other_thread`), and a
throughput comparison, plugin off against on, is what sees what it costs the steps. Off (the
default), `install()` checks the switch once and nothing here is imported: no step pays
anything.

The totals are written as one small JSON file, `vllm-cost-<pid>.json`, into the directory
`KVLEDGER_VLLM_COST_DIR` names, whenever the engine core goes idle after stepping
(`has_requests()` answering False: vLLM is about to block on its input queue, so the write
costs no step anything) and at exit. Why a file rewritten at idle rather than a log line at
shutdown: a bench reads the totals between its rounds, while the server runs, and vLLM's
shutdown kills its engine core (no log line is promised then). Why not a metric: the cost
mode must not add a path to the exporter or to vLLM's API server.

The directory is a trust boundary like the snapshot directory (`accounting.snapfile.
directory`): it must exist already (the bench makes it, 0700), be a real directory, not a
link, owned by this user (or root) and writable by no one else, and every write goes
relative to the descriptor opened then. The file is created exclusively: anything already
at its name (a link, a file) is refused, never followed or replaced; later writes replace
the file only while it is still the one this process wrote. A failed write is one log line
and the cost mode stops writing; vLLM carries on. A missing or bad directory at install is
a ValueError naming the variable (vLLM's start-up fails: a bench must not run unmeasured).

Single-threaded by design: the engine core's busy loop is the only caller of the timed
methods (as `hooks` assumes for the scheduler); the counters are plain attributes.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import stat
import threading
from collections.abc import Callable
from time import perf_counter_ns, thread_time_ns, time
from typing import Any

from kvledger.engines.vllm.patch import MethodPatch
from kvledger.engines.vllm.switches import ENV_COST_DIR
from kvledger.gc_clock import GcClock

log = logging.getLogger(__name__)

FORMAT = "kvledger-vllm-cost/1"
FILE_PREFIX = "vllm-cost-"
ENGINE_CORE_MODULE = "vllm.v1.engine.core"
TIMED_HOOKS = ("schedule", "has_requests")  # kvledger's scheduler wrappers on the step path
POOL = "block_pool"  # the evictable counter's wrappers on the pool's instance (occupancy.py)
METERED = (*TIMED_HOOKS, POOL)
# Parts of kvledger's time, timed again inside it for a breakdown (never added to it):
# the occupancy's refresh and a publish, in a step, between steps (the idle publish), or on
# another thread (the publisher's heartbeat when nothing published for two intervals, and
# its encode and write of the snapshots the engine core hands over: `Publisher.submit`).
# On the engine core's thread a publish is `Publisher.publish` or `Publisher.submit` (the
# snapshot and the hand-over), whichever the process ledger calls.
PARTS = (
    "refresh",
    "publish",
    "refresh_between_steps",
    "publish_between_steps",
    "publish_other_thread",
)
STEP_METHODS = ("step", "step_with_batch_queue")  # the engine core's step, either kind
CALIBRATION_CALLS = 2000

_lock = threading.Lock()
_meter: Meter | None = None
_atexit = False


class HookTotals:
    """One hook's running totals: calls, kvledger's ns (sum, worst call, and the garbage
    collector's pauses that fell inside them), vLLM's ns, and a histogram of kvledger's ns
    per call (`hist[k]`: calls of 2**(k-1) to 2**k - 1 ns)."""

    __slots__ = ("calls", "cpu_ns", "gc_ns", "hist", "max_ns", "ns", "vllm_ns")

    def __init__(self) -> None:
        self.calls = 0
        self.ns = 0
        self.max_ns = 0
        self.vllm_ns = 0
        self.gc_ns = 0
        self.cpu_ns = 0  # the thread's CPU time (parts only)
        self.hist = [0] * 64

    def add(self, total_ns: int, vllm_ns: int, gc_ns: int = 0, cpu_ns: int = 0) -> None:
        own = max(total_ns - vllm_ns, 0)
        self.calls += 1
        self.cpu_ns += cpu_ns
        self.ns += own
        self.vllm_ns += vllm_ns
        self.gc_ns += gc_ns
        self.hist[min(own.bit_length(), 63)] += 1
        if own > self.max_ns:
            self.max_ns = own

    def to_dict(self) -> dict[str, Any]:
        top = max((k for k, n in enumerate(self.hist) if n), default=0)
        return {
            "calls": self.calls,
            "ns": self.ns,
            "max_ns": self.max_ns,
            "vllm_ns": self.vllm_ns,
            "gc_ns": self.gc_ns,
            "cpu_ns": self.cpu_ns,
            "hist_log2_ns": self.hist[: top + 1],
        }


class Totals:
    """What the timed wrappers add to: per hook, kvledger's time inside the engine core's
    steps (`hooks`) and, for all hooks together, outside them (`outside`: `has_requests`
    asked by the busy loop between steps, the publish when the engine goes idle); the steps;
    the garbage collector's pauses (`gc`, a `GcClock`)."""

    def __init__(self) -> None:
        self.hooks = {name: HookTotals() for name in METERED}
        self.outside = HookTotals()
        self.parts = {name: HookTotals() for name in PARTS}
        self.loop_thread: int | None = None  # the engine core's busy loop (its first step)
        self.part_depth = 0
        self.in_step = False
        self.steps = 0
        self.steps_executed = 0  # steps that ran the model (vLLM's own flag)
        self.step_ns = 0
        self.step_max_ns = 0
        self.gc = GcClock()  # installed by `install()`, taken out by `Meter.close()`

    def add_step(self, ns: int, executed: bool) -> None:
        self.steps += 1
        self.steps_executed += executed
        self.step_ns += ns
        if ns > self.step_max_ns:
            self.step_max_ns = ns


class Meter(Totals):
    """The totals of one process and the file they are written to.

    `directory`: an existing private directory (see the module's docstring); a missing or
    bad one raises ValueError naming `KVLEDGER_VLLM_COST_DIR` and the path."""

    def __init__(self, directory: str, *, pid: int | None = None) -> None:
        from accounting.snapfile.directory import SnapshotDir, SnapshotDirError

        if not directory:
            raise ValueError(
                f"{ENV_COST_DIR} is unset or empty; the cost mode (KVLEDGER_VLLM_COST=1) "
                "needs an existing private directory (mode 0700) to write its totals into"
            )
        try:
            self.dir = SnapshotDir(directory, create=False)
        except FileNotFoundError:
            raise ValueError(
                f"{ENV_COST_DIR}={directory!r}: no such directory; create it first (mode 0700)"
            ) from None
        except (SnapshotDirError, OSError) as e:
            raise ValueError(f"{ENV_COST_DIR}={directory!r}: {e}") from None
        super().__init__()
        self.pid = os.getpid() if pid is None else pid
        self.name = f"{FILE_PREFIX}{self.pid}.json"
        self.writes = 0
        self.timer_ns: float | None = None
        self.broken = ""  # why writing stopped
        self._written: tuple[int, int, int] | None = None  # (st_dev, st_ino, size) of ours
        self._written_steps = -1

    # -- reading --------------------------------------------------------------------------
    def snapshot(self, *, idle: bool) -> dict[str, Any]:
        hooks = {name: t.to_dict() for name, t in self.hooks.items()}
        return {
            "format": FORMAT,
            "pid": self.pid,
            "written_unix_s": round(time(), 6),
            "idle": idle,
            "writes": self.writes + 1,
            "steps": self.steps,
            "steps_executed": self.steps_executed,
            "step_ns": self.step_ns,
            "step_max_ns": self.step_max_ns,
            "hooks": hooks,  # inside the steps
            "hook_ns": sum(h["ns"] for h in hooks.values()),
            "hook_calls": sum(h["calls"] for h in hooks.values()),
            "hook_max_ns": max((h["max_ns"] for h in hooks.values()), default=0),
            "hook_gc_ns": sum(h["gc_ns"] for h in hooks.values()),
            "outside_step": self.outside.to_dict(),
            "parts": {name: t.to_dict() for name, t in self.parts.items()},
            "gc": {"count": self.gc.count, "ns": self.gc.ns},
            "timer_ns": self.timer_ns,
        }

    # -- writing --------------------------------------------------------------------------
    def flush(self, *, idle: bool, force: bool = False) -> bool:
        """Write the totals if a step ran since the last write (or `force`, once anything
        was recorded). Returns True when written. Never raises: a failure is one log line
        and writing stops."""
        if self.broken or self.dir.closed:
            return False
        recorded = self.steps or self.outside.calls or any(t.calls for t in self.hooks.values())
        if not recorded or (self.steps == self._written_steps and not force):
            return False
        try:
            if self.timer_ns is None:
                self.timer_ns = calibrate()
            self._write(json.dumps(self.snapshot(idle=idle), sort_keys=True).encode())
        except Exception as e:
            self.broken = f"{type(e).__name__}: {e}"
            log.warning(
                "kvledger: the cost mode stopped writing %s/%s: %s",
                self.dir.path,
                self.name,
                self.broken,
            )
            return False
        self.writes += 1
        self._written_steps = self.steps
        return True

    def _write(self, data: bytes) -> None:
        try:
            st = self.dir.lstat(self.name)
        except FileNotFoundError:
            st = None
        if self._written is None:
            if st is not None:  # created exclusively: never follow, never replace
                raise FileExistsError(
                    f"{self.dir.path}/{self.name} exists already "
                    f"({_kind(st.st_mode)}); refusing to write over it"
                )
        elif (
            st is None
            or not stat.S_ISREG(st.st_mode)
            or (st.st_dev, st.st_ino, st.st_size) != self._written
        ):  # (an inode number alone can be reused by whatever took the name)
            what = "gone" if st is None else f"replaced by {_kind(st.st_mode)}"
            raise FileExistsError(
                f"{self.dir.path}/{self.name} is {what} since this process wrote it; "
                "refusing to write"
            )
        self._written = (*self.dir.write_replace(self.name, data), len(data))

    def close(self) -> None:
        """A last write (whatever changed), then the directory is closed. Idempotent."""
        self.gc.close()
        if self.dir.closed:
            return
        self.flush(idle=False, force=True)
        self.dir.close()


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "a special file"


# -- the timed wrappers ----------------------------------------------------------------------
def timed_hook(
    make: Callable[[Callable[..., Any]], Callable[..., Any]],
    meter: Totals,
    name: str,
    on_result: Callable[[Any], None] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`make` (a `MethodPatch` wrapper factory) with timers: vLLM's method inside it and the
    whole wrapper around it, added to `meter.hooks[name]` during a step, else to
    `meter.outside`. `on_result(result)` runs after the timed part (untimed)."""
    totals = meter.hooks[name]
    outside = meter.outside

    def make_timed(original: Callable[..., Any]) -> Callable[..., Any]:
        inner = [0, 0]  # vLLM's own ns and GC ns in the current call (one thread calls these)

        def vllm_method(*args: Any, **kwargs: Any) -> Any:
            gc0 = meter.gc.ns
            t0 = perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                inner[0] = perf_counter_ns() - t0
                inner[1] = meter.gc.ns - gc0

        hooked = make(vllm_method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            inner[0] = inner[1] = 0
            gc0 = meter.gc.ns
            t0 = perf_counter_ns()
            try:
                out = hooked(*args, **kwargs)
            finally:
                ns = perf_counter_ns() - t0
                gc_own = meter.gc.ns - gc0 - inner[1]
                (totals if meter.in_step else outside).add(ns, inner[0], gc_own)
            if on_result is not None:
                on_result(out)
            return out

        return timed

    return make_timed


def timed_step(meter: Totals) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A wrapper factory timing the engine core's step (it returns (outputs, executed))."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            if meter.loop_thread is None:
                meter.loop_thread = threading.get_ident()
            meter.in_step = True
            t0 = perf_counter_ns()
            try:
                out = original(*args, **kwargs)
            finally:
                ns = perf_counter_ns() - t0
                meter.in_step = False
            executed = bool(out[1]) if isinstance(out, tuple) and len(out) == 2 else True
            meter.add_step(ns, executed)
            return out

        return step

    return make


def timed_part(meter: Totals, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A wrapper factory adding a kvledger method's whole time to `meter.parts[name]` in a
    step, `name_between_steps` between them, `name_other_thread` off the engine core's loop
    (where that part exists; else counted as between steps). Its thread's CPU time too
    (`time.thread_time_ns()`, a system call: fine once a publish): wall time well above it
    is time the thread waited (preempted, or on the publisher's lock). A part called inside
    another (a publish from the ledger's event hook during a refresh) is left to the outer."""
    here = meter.parts[name]
    between = meter.parts[f"{name}_between_steps"]
    there = meter.parts.get(f"{name}_other_thread", between)

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def part(*args: Any, **kwargs: Any) -> Any:
            loop = meter.loop_thread
            other = loop is not None and threading.get_ident() != loop
            if not other and meter.part_depth:  # inside another part: timed there already
                return original(*args, **kwargs)
            meter.part_depth += not other
            c0 = thread_time_ns()
            t0 = perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                ns = perf_counter_ns() - t0
                cpu = thread_time_ns() - c0
                meter.part_depth -= not other
                (there if other else here if meter.in_step else between).add(ns, 0, cpu_ns=cpu)

        return part

    return make


def calibrate(calls: int = CALIBRATION_CALLS) -> float:
    """The timer's own share of a hook's measured ns: the mean "kvledger" ns of a timed hook
    whose wrapper does nothing but call the method (a no-op), best of 5 batches."""
    best = float("inf")
    for _ in range(5):
        scratch = Totals()
        scratch.in_step = True
        fn = timed_hook(_passthrough, scratch, POOL)(_noop)
        for _ in range(calls):
            fn()
        best = min(best, scratch.hooks[POOL].ns / calls)
    return round(best, 1)


def _passthrough(original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    return wrapper


def _noop() -> None:
    return None


# -- installing ------------------------------------------------------------------------------
def instrument(patches: list[MethodPatch], *, step_class: type | None = None) -> list[MethodPatch]:
    """kvledger's patches with the step-path hooks timed, plus the engine core's step
    patches (`step_class`: vLLM's `EngineCore` unless given). Call before applying them.
    Raises ValueError when `KVLEDGER_VLLM_COST_DIR` is missing or bad."""
    global _meter, _atexit
    meter = Meter(os.environ.get(ENV_COST_DIR, ""))
    if step_class is None:
        import importlib

        step_class = importlib.import_module(ENGINE_CORE_MODULE).EngineCore
    out: list[MethodPatch] = []
    for p in patches:
        if p.name in TIMED_HOOKS:
            idle = _on_has_requests(meter) if p.name == "has_requests" else None
            p = MethodPatch(p.cls, p.name, timed_hook(p.make, meter, p.name, idle))
        out.append(p)
    # The evictable counter wraps methods of the pool's free queue and of the pool itself,
    # per instance (`EvictableCounter._wrap`): kvledger's code inside vLLM's own schedule and
    # update_from_output. Timed too, as one total.
    from kvledger.engines.vllm.occupancy import EvictableCounter

    out.append(MethodPatch(EvictableCounter, "_wrap", _timed_pool_wraps(meter)))
    # The breakdown: kvledger's own classes, timed again inside the hooks' time.
    from accounting.snapfile.writer import Publisher
    from kvledger.engines.vllm.occupancy import SchedulerOccupancy

    out.append(MethodPatch(SchedulerOccupancy, "refresh", timed_part(meter, "refresh")))
    out.append(MethodPatch(Publisher, "publish", timed_part(meter, "publish")))
    out.append(MethodPatch(Publisher, "submit", timed_part(meter, "publish")))
    out.append(MethodPatch(Publisher, "_write_submitted", timed_part(meter, "publish")))
    for name in STEP_METHODS:
        if callable(getattr(step_class, name, None)):
            out.append(MethodPatch(step_class, name, timed_step(meter)))
    if not any(p.name in STEP_METHODS for p in out):
        meter.dir.close()
        raise ValueError(
            f"KVLEDGER_VLLM_COST=1: {step_class.__module__}.{step_class.__qualname__} has none "
            f"of {', '.join(STEP_METHODS)}; the cost mode cannot time this vLLM's step"
        )
    meter.gc.install()
    with _lock:
        old, _meter = _meter, meter
        if not _atexit:
            atexit.register(close)
            _atexit = True
    if old is not None:
        old.close()
    return out


def _timed_pool_wraps(meter: Totals) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _wrap(self: Any, owner: Any, name: str, make_: Callable[[Any], Any]) -> Any:
            return original(self, owner, name, timed_hook(make_, meter, POOL))

        return _wrap

    return make


def _on_has_requests(meter: Meter) -> Callable[[Any], None]:
    def idle(busy: Any) -> None:
        if not busy:
            meter.flush(idle=True)

    return idle


def meter() -> Meter | None:
    """This process's meter (None unless the cost mode was installed)."""
    return _meter


def close() -> None:
    """Write the last totals and close (atexit; tests). Idempotent."""
    global _meter
    with _lock:
        m, _meter = _meter, None
    if m is not None:
        m.close()


def read(path: str) -> dict[str, Any]:
    """A cost file's totals (for the bench and the tests): opened without following a link,
    refused unless a regular file in `FORMAT`."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > 1 << 20:
            raise ValueError(f"{path}: not a regular file of at most 1 MiB")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = json.loads(f.read())
    finally:
        os.close(fd)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a kvledger vLLM cost file (format {FORMAT!r})")
    return data
