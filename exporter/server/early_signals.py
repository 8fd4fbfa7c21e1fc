"""SIGINT from the moment a `kvledger` command starts until the command takes the signals over.

Python's own SIGINT handler raises KeyboardInterrupt wherever the main thread happens to be,
and the interpreter itself can drop it: one raised while importlib runs a module lock's
weakref callback is printed as "Exception ignored in: <function _get_module_lock.<locals>.cb>"
and goes no further (seen: `kvledger serve` interrupted 0.35 s into its start-up, on a
2-core machine kept busy, went on to serve in 3 of 110 start-ups). So the entry points
(`python -m kvledger`, the `kvledger` script through `kvledger.cli.main`) first put a
handler of their own in place (`install`): it notes the signal, then raises
KeyboardInterrupt exactly as Python's handler would. A command that installs handlers of
its own (`kvledger serve`'s start-up, `kvledger.serve.StartUp`) asks `received()` right
after and stops if a signal came before.

Only SIGINT: SIGTERM's default action ends the process, nothing can drop it. Before an entry
point runs (the interpreter's start, `site`) nothing of kvledger's can listen; a signal there
ends the process or is dropped by the interpreter, as for any Python program.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

_received: str | None = None


def _record(sig: int, frame: FrameType | None) -> None:
    global _received
    _received = signal.Signals(sig).name
    raise KeyboardInterrupt


def install() -> None:
    """Put the recording handler in place of Python's default one (main thread only). Where
    SIGINT has another handler (a parent that ignores it, a program embedding kvledger that
    set its own) nothing changes. Idempotent."""
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers (and only it receives them)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _record)


def received() -> str | None:
    """The name of the signal recorded ("SIGINT"), None while none came."""
    return _received
