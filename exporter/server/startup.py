"""SIGINT and SIGTERM while a server starts: the first ends the start-up wherever it is, with
every `finally` on the way out run, so nothing is left behind."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from exporter.server import early_signals

_deferring = 0  # `signals_deferred` blocks running (main thread)
_active: StartUp | None = None  # the start-up whose handler is in force (`taken_over`)


class StartupStopped(BaseException):
    """SIGINT or SIGTERM before the server runs; a BaseException, like KeyboardInterrupt, so
    that no `except Exception` on the way swallows it and every `finally` runs."""


class StartUp:
    """SIGINT and SIGTERM from the start of `run` until the server takes over its own
    handlers: the first ends the start-up wherever it is (the handler raises
    `StartupStopped` in the main thread; the pool's build is interrupted between chunks), so
    cleanup runs on the way out and nothing is left behind; a second one while that cleanup
    runs is let be.

    An exception raised by a signal handler goes wherever the main thread is, and code
    there may swallow it: here the handler ran inside numpy's import (under torch) and
    inside the demo pool's build, the exception went nowhere, and the server started
    anyway (in 1 to 5 of 30 to 60 start-ups interrupted in their first 1.5 s). Which
    library drops it is not known. So the signal is also recorded, and `check()`, called
    before the server takes over, raises it again."""

    def __init__(self) -> None:
        self.signal: str | None = None

    def handle(self, sig: int, frame: FrameType | None) -> None:
        if self.signal is not None:
            return  # a second signal while cleaning up: let the cleanup finish
        self.signal = signal.Signals(sig).name
        if _deferring:
            return  # recorded: raised as the deferred block ends (`signals_deferred`)
        raise StartupStopped(self.signal)

    def check(self) -> None:
        """Raise `StartupStopped` if a signal came (whatever became of its exception)."""
        if self.signal is not None:
            raise StartupStopped(self.signal)


@contextmanager
def taken_over() -> Iterator[StartUp]:
    """SIGINT and SIGTERM handled by a `StartUp` inside the block (a Ctrl-C recorded by
    `early_signals` before it counts as one), the previous handlers back after it."""
    global _active
    start_up = StartUp()
    previous: dict[int, Callable[..., Any] | int | None] = {}
    outer, _active = _active, start_up
    try:
        for taken in (signal.SIGINT, signal.SIGTERM):
            previous[taken] = signal.signal(taken, start_up.handle)
        if start_up.signal is None:  # a Ctrl-C before them, whatever became of its exception
            start_up.signal = early_signals.received()
        start_up.check()
        yield start_up
    finally:
        _active = outer
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM held back while the block runs, then delivered as it ends: for an
    import of a C extension (numpy under torch), which an exception raised by a signal
    handler in the middle of it leaves half-done and unimportable for the rest of the
    process ("cannot load module more than once per process", seen 0.6 s into a loaded
    `kvledger serve` start-up). Main thread only, like every signal handler.

    The mask holds them back only from this thread: with other threads alive (a publisher,
    a scan) the kernel may hand a process-directed signal to one of them, and Python then
    runs the handler in this thread at once. So the `StartUp` handler in force also only
    records a signal while a deferred block runs, and it is raised as the block ends."""
    global _deferring
    held = {signal.SIGINT, signal.SIGTERM}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
        signal.pthread_sigmask(signal.SIG_SETMASK, before)  # one held here is delivered now
    if not _deferring and _active is not None:
        _active.check()  # one another thread took, recorded meanwhile
