"""exporter.server.startup: SIGINT and SIGTERM while a server starts."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from exporter.server import early_signals
from exporter.server.startup import StartUp, StartupStopped, signals_deferred, taken_over


def test_a_start_up_signal_whose_exception_was_swallowed_still_stops_it():
    """The start-up handler raises where the main thread is; code there may swallow the
    exception (seen inside numpy's import and the demo pool's build), and the server then
    started anyway. The signal is recorded, and `check()` (called before the server takes
    over) raises it again."""
    start_up = StartUp()
    start_up.check()  # no signal yet: nothing
    with contextlib.suppress(BaseException):  # what the swallowing code does
        start_up.handle(signal.SIGINT, None)
    start_up.handle(signal.SIGTERM, None)  # a second one is let be: it does not raise
    with pytest.raises(StartupStopped, match="SIGINT"):
        start_up.check()


def test_taken_over_restores_the_handlers_and_counts_an_early_ctrl_c(monkeypatch):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with taken_over() as start_up:
        assert signal.getsignal(signal.SIGINT) == start_up.handle
        assert signal.getsignal(signal.SIGTERM) == start_up.handle
    assert {s: signal.getsignal(s) for s in before} == before
    monkeypatch.setattr(early_signals, "received", lambda: "SIGINT")
    with pytest.raises(StartupStopped, match="SIGINT"), taken_over():
        pytest.fail("a Ctrl-C recorded before the start-up must end it at once")
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_signal_inside_a_deferred_block_arrives_as_it_ends() -> None:
    reached = []
    with pytest.raises(StartupStopped, match="SIGINT"), taken_over():
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            reached.append("the block ran to its end")
        reached.append("never: the signal is delivered as the block ends")
    assert reached == ["the block ran to its end"]
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == set()  # nothing left blocked


def test_a_signal_another_thread_takes_inside_a_deferred_block_waits_for_its_end() -> None:
    """The mask holds a signal back from the main thread only: with another thread alive
    that does not block it, the kernel may deliver it there, and Python runs the handler in
    the main thread at once. The handler only records it inside a deferred block."""
    import threading

    stop = threading.Event()
    # a thread with SIGINT unblocked: started before the block masks it in the main thread
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    import time

    reached = []
    try:
        with pytest.raises(StartupStopped, match="SIGINT"), taken_over() as start_up:
            with signals_deferred():
                assert other.ident is not None
                signal.pthread_kill(other.ident, signal.SIGINT)  # delivered to that thread
                deadline = time.monotonic() + 10
                while start_up.signal is None and time.monotonic() < deadline:
                    time.sleep(0.001)  # the handler runs in the main thread, here
                assert start_up.signal == "SIGINT"
                reached.append("the block ran to its end")
            reached.append("never: raised as the block ends")
    finally:
        stop.set()
        other.join()
    assert reached == ["the block ran to its end"]
