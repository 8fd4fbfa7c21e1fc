"""exporter.server.early_signals: a Ctrl-C before a command takes the signals over is recorded, even
when the interpreter drops its KeyboardInterrupt. Each case in a process of its own (the
handlers are the process's)."""

from __future__ import annotations

import subprocess
import sys

from tests.servers import repo_env, sigint_default

# A KeyboardInterrupt dropped the way the interpreter drops it: raised inside a weakref
# callback ("Exception ignored in: ..."), as importlib's module-lock callback did.
DROP = """
import signal, weakref
class _T: pass
_t = _T()
_r = weakref.ref(_t, lambda _: signal.raise_signal(signal.SIGINT))
del _t
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    with sigint_default():  # a child as from a terminal, whatever ran the tests
        return subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=repo_env(),
            timeout=60,
        )


def test_a_dropped_ctrl_c_is_recorded() -> None:
    proc = _run(
        "from exporter.server import early_signals\n"
        "early_signals.install()\n" + DROP + "print('went on', early_signals.received())\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "Exception ignored" in proc.stderr and "KeyboardInterrupt" in proc.stderr
    assert proc.stdout.strip() == "went on SIGINT"


def test_without_it_the_same_ctrl_c_is_lost() -> None:
    """The control: what the module is for (nothing records the dropped signal)."""
    proc = _run(
        "from exporter.server import early_signals\n" + DROP + "print(early_signals.received())"
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stderr


def test_a_ctrl_c_still_raises_keyboard_interrupt() -> None:
    proc = _run(
        "import signal\n"
        "from exporter.server import early_signals\n"
        "early_signals.install(); early_signals.install()\n"
        "try:\n"
        "    signal.raise_signal(signal.SIGINT)\n"
        "except KeyboardInterrupt:\n"
        "    print('raised', early_signals.received())\n"
    )
    assert proc.stdout.strip() == "raised SIGINT", proc.stderr


def test_a_handler_someone_else_set_is_left_alone() -> None:
    proc = _run(
        "import signal, threading\n"
        "from exporter.server import early_signals\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "early_signals.install()\n"
        "print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "done = []\n"
        "def off_main():\n"
        "    early_signals.install()\n"
        "    done.append(True)  # not reached if install raised (signal only works in main thread)\n"
        "t = threading.Thread(target=off_main); t.start(); t.join()\n"
        "print(done == [True] and signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]  # not replaced; no error off the main thread
