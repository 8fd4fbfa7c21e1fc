"""Real servers for tests, on 127.0.0.1 only: uvicorn in a thread, Debian's Prometheus as a process,
`kvledger serve` as a process.

Each is a context manager that stops what it started.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
import yaml

from kvledger.tools.bench.serve_child import ServeChild

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (httpx.HTTPError, OSError) as e:
            last = e
        else:
            if last:
                return last
        time.sleep(interval)
    raise TimeoutError(f"{what}: not true after {timeout} s (last: {last!r})")


class UvicornThread:
    """Serve an ASGI app with real uvicorn on a loopback socket bound before start."""

    def __init__(self, app: Any) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = int(self._sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def __enter__(self) -> UvicornThread:
        self._thread.start()
        wait_until(lambda: self.server.started, 10, "uvicorn started")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self._sock.close()


class Prometheus:
    """Debian's prometheus scraping `targets` every `interval`, with its own config and storage."""

    def __init__(
        self,
        targets: list[str],
        *,
        interval: str = "1s",
        job: str = "kvledger",
        scrape_configs: list[dict[str, Any]] | None = None,
    ) -> None:
        """`scrape_configs`, when given, replaces the one static job of `targets`."""
        self.dir = Path(tempfile.mkdtemp(prefix="kvledger-prom-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.job = job
        if scrape_configs is None:
            scrape_configs = [{"job_name": job, "static_configs": [{"targets": list(targets)}]}]
        (self.dir / "prometheus.yml").write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": interval, "scrape_timeout": interval},
                    "scrape_configs": scrape_configs,
                },
                sort_keys=False,
            )
        )
        self._log = open(self.dir / "prometheus.log", "wb")  # noqa: SIM115 - closed in __exit__
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Prometheus:
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_until(
                lambda: httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200,
                20,
                f"prometheus ready (log: {self.dir / 'prometheus.log'})",
                interval=0.1,
            )
        except BaseException:
            self.__exit__()
            raise
        return self

    def query(self, expr: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=5)
        r.raise_for_status()
        body = r.json()
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus query {expr!r}: {body}")
        return list(body["data"]["result"])

    def series(self, match: str) -> list[dict[str, str]]:
        r = httpx.get(f"{self.url}/api/v1/series", params={"match[]": match}, timeout=5)
        r.raise_for_status()
        return list(r.json()["data"])

    def log_text(self) -> str:
        return (self.dir / "prometheus.log").read_text(errors="replace")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def repo_env() -> dict[str, str]:
    """The environment for a child Python that imports this worktree's packages."""
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@contextlib.contextmanager
def sigint_default() -> Iterator[None]:
    """Children started inside get SIGINT at its default, as from a terminal, even where the
    tests run with SIGINT ignored (a run started in the background: a shell's `&` ignores it
    for the job, and an ignored signal stays ignored across exec). exec resets a handler, so
    Python's own handler set for the duration of the start is enough."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


class ServeProcess(ServeChild):
    """`python -m kvledger serve ARGS` as deployed, importing this worktree's packages
    (`repo_env`): the bench's starter (`kvledger.tools.bench.serve_child`) in the tests'
    environment. `.url`, `.proc`; `close()` returns the exit status."""

    def __init__(
        self,
        args: list[str],
        *,
        stderr: Any = subprocess.DEVNULL,
        preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(args, stderr=stderr, env=repo_env(), preexec_fn=preexec_fn)


def stop(proc: subprocess.Popen[Any], timeout: float = 10) -> None:
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
