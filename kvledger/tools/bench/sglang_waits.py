"""The waits the serving loop's scheduler thread makes on the device, counted and timed
(`kvledger bench sglang --part serving`).

`WaitLog` keeps them: those on the scheduler's thread (its `owner`) counted by kind with the
seconds they blocked, those on other threads (the background mapper's) only counted. On CUDA
`CudaSyncWatch` fills it: each synchronisation torch's sync debug mode reports (`warn`) plus
every `torch.cuda.Event.synchronize` / `torch.cuda.Stream.synchronize` call (wrapped and
timed; an implicit synchronisation, e.g. a copy to the host, is counted and charged the whole
phase it happened in: an upper bound). On the host backend `ModelReader` replaces the
bridge's id reader and gives its reads and fences CUDA's ordering behind the forward
(`sglang_forward.HostDevice`): a read is there once the forwards launched before it are done;
a wait for one before that blocks until they are, and is counted and timed (exact).
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from kvledger.tools.bench.sglang_forward import HostDevice

# A replacement for a torch method: `wrap(class name, the original)` -> the method.
Wrap = Callable[[str, Callable[[Any], Any]], Callable[[Any], Any]]


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


class _ModelPending:
    """A read (`read` given: `ready()`, `lists()`) or a fence (`done()`, `wait()`) the
    scheduler queued after forward `mark`: there once that forward has run; waited for
    before, it blocks as `kind`."""

    __slots__ = ("_kind", "_mark", "_read", "_reader")

    def __init__(self, reader: ModelReader, mark: int, kind: str, read: Any = None) -> None:
        self._reader, self._mark, self._kind, self._read = reader, mark, kind, read

    def done(self) -> bool:
        return self._reader.device.done(self._mark)

    ready = done

    def wait(self) -> None:
        if not self.done():
            self._reader.block(self._kind, self._mark)

    def lists(self) -> list[list[int]]:
        self.wait()
        return self._read.lists()


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

    def read_many(self, items: list[tuple[Any, int | None]]) -> _ModelPending:
        return _ModelPending(self, self.device.launched, "read", self._host.read_many(items))

    def fence_now(self) -> _ModelPending:
        return _ModelPending(self, self.device.launched, "device fence")

    def stream_fence(self) -> _ModelPending:
        return _ModelPending(self, self.device.launched, "stream fence")


def model_reader(bridge: Any, device: HostDevice, log: WaitLog | None = None) -> ModelReader:
    """Give a host-backend bridge `ModelReader` (its policy's and journal's reader), and make
    its page store's device drain (`Backend.synchronize`, which host memory never needs: the
    store calls it at close, before unmapping) a modelled wait for every forward launched,
    as CUDA's is."""
    reader = ModelReader(device, log)
    bridge.policy.reader = reader
    bridge.policy.journal.reader = reader
    backend = bridge.store.pages.backend
    drain = backend.synchronize

    def synchronize() -> None:
        reader.block("device drain", device.launched)
        drain()

    backend.synchronize = synchronize  # this bridge's own backend, closed with it
    return reader


@contextlib.contextmanager
def synchronize_wrapped(wrap: Wrap) -> Iterator[None]:
    """`torch.cuda.Event.synchronize` and `torch.cuda.Stream.synchronize` (which torch's sync
    debug mode does not see) replaced by `wrap("Event" / "Stream", the original)` inside the
    block."""
    import torch

    originals = {cls: cls.synchronize for cls in (torch.cuda.Event, torch.cuda.Stream)}
    for cls, fn in originals.items():
        _cls(cls).synchronize = wrap(cls.__name__, fn)
    try:
        yield
    finally:
        for cls, fn in originals.items():
            _cls(cls).synchronize = fn


def _cls(c: Any) -> Any:
    """A torch class whose method is swapped for the time of a measurement (untyped here)."""
    return c


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
        watch = self

        def timed(name: str, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
            kind = f"{name.lower()} synchronize"

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

        records = self._records

        def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            # The debug mode is process-wide: only the scheduler thread's reports count (the
            # mapper's fence waits are its own business, off that thread).
            if threading.get_ident() == watch.log.owner:
                records.append(str(message))

        with synchronize_wrapped(timed):
            mode = torch.cuda.get_sync_debug_mode()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("always")
                    warnings.showwarning = show
                    torch.cuda.set_sync_debug_mode("warn")
                    yield
            finally:
                torch.cuda.set_sync_debug_mode(mode)

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
