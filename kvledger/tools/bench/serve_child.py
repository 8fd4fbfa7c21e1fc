"""`kvledger serve` in a child process, for the benchmarks that measure it as deployed.

The child imports the same kvledger as the caller, installed or not.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, TypeVar

_URL_PREFIXES = ("kvledger serve: http://", "kvledger serve: https://")
_Self = TypeVar("_Self", bound="ServeChild")


class ServeChild:
    """`python -m kvledger serve ARGS`; `.url` is its base URL (no `/metrics`), `.proc` the child.

    `env`: the child's environment (default: this one, with the directory holding
    `kvledger` first on PYTHONPATH); `preexec_fn`: run in the child before it starts (a
    lowered resource limit, say); `cwd`: its working directory, which `python -m` searches
    before PYTHONPATH (another tree's server needs both). Raises RuntimeError, with what the child printed,
    when it does not announce its URL. `close()` (idempotent, also the context
    manager's exit) sends SIGINT, waits, and kills it if it does not stop; it returns
    the exit status.
    """

    def __init__(
        self,
        args: Sequence[str],
        *,
        stderr: int | IO[Any] | None = subprocess.DEVNULL,
        env: Mapping[str, str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
        cwd: str | None = None,
    ) -> None:
        if env is None:
            import kvledger

            root = os.path.dirname(os.path.dirname(os.path.abspath(kvledger.__file__)))
            path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
            env = {**os.environ, "PYTHONPATH": path}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvledger", "serve", *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=dict(env),
            preexec_fn=preexec_fn,
            cwd=cwd,  # `python -m` looks in the working directory first
        )
        if self.proc.stdout is None:  # pragma: no cover - stdout=PIPE above
            raise RuntimeError("kvledger serve: no pipe to read its URL from")
        line = self.proc.stdout.readline()
        if not line.startswith(_URL_PREFIXES):
            self.close()
            raise RuntimeError(
                f"kvledger serve printed {line!r}, expected its URL ({_URL_PREFIXES[0]}...)"
            )
        self.url = line.split()[2].removesuffix("/metrics")

    def cpu_seconds(self) -> float:
        """User + system CPU of the child so far (clock-tick resolution; Linux /proc)."""
        with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self, timeout: float = 10) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
