"""scripts/install-torch: the pip command it would run (`--print`), and what that command resolves,
with pip's `--dry-run --report`, on a machine whose pip sees no local wheel.

pip's configuration is shut out of every dry-run here (no PIP_* variables, `PIP_CONFIG_FILE`
set to /dev/null, `--isolated`): no find-links, no local index, no constraint file, so what
the report lists is what the command alone resolves. Three cases:

- PyTorch's CPU index answers (a user's machine): the script names it, and the dry-run
  against it resolves torch 2.13.0+cpu and no NVIDIA/CUDA package. Skipped where that
  index cannot be reached (here: only package registries are).
- A CPU index that answers, served on loopback from this machine's CPU wheel of torch
  (its metadata served beside it, PEP 658): the script's probe finds it, the command it
  builds takes torch from it, and with PyPI beside it for torch's dependencies (whose own
  torch 2.13.0 is the CUDA build) the dry-run still resolves torch 2.13.0+cpu and no NVIDIA
  or CUDA package. Skipped without such a wheel on disk, or without PyPI. (pip 23.2 resolves
  from the metadata but then fetches the chosen wheels even in a dry run: the torch wheel
  comes over loopback from local disk, its small dependencies from PyPI.)
- PyTorch's CPU index does not answer: one line says so and names the configured index;
  the command is plain `pip install torch==2.13.0`, which finds the local CPU wheel here
  and the CUDA build from PyPI alone. What that command would resolve from PyPI alone is
  not dry-run here: pip 23.2 fetches every chosen wheel in a dry run (2.7 GB for that one);
  tried by hand it gave torch 2.13.0 and 28 packages more, 18 of them NVIDIA/CUDA.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shlex
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "install-torch"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYPI = "https://pypi.org/simple"
TORCH = "2.13.0"
CUDA_PACKAGES = ("nvidia-", "cuda-", "triton")


def _script(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_TORCH_")}
    full.update({"KVLEDGER_TORCH_GPU": "0", **env})
    return subprocess.run(
        [str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=60,
        check=False,
    )


def _printed(**env: str) -> tuple[str, list[str]]:
    r = _script("--print", sys.executable, **env)
    assert r.returncode == 0, r.stderr
    said, command = r.stdout.splitlines()
    return said, shlex.split(command)


def _reachable(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _dry_run(command: list[str], tmp_path: Path, *extra: str) -> list[dict[str, str]]:
    """`command` (a pip install) as a dry run with pip's configuration shut out: the name,
    version and URL of everything it would install."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    report = tmp_path / "report.json"
    args = [*command, "--isolated", "--dry-run", "--ignore-installed", "--report", str(report)]
    r = subprocess.run(
        [*args, *extra], capture_output=True, text=True, env=env, timeout=600, check=False
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return [
        {
            "name": item["metadata"]["name"].lower(),
            "version": item["metadata"]["version"],
            "url": item["download_info"]["url"],
        }
        for item in json.loads(report.read_text())["install"]
    ]


def _assert_cpu_only(resolved: list[dict[str, str]], index: str) -> None:
    [torch] = [p for p in resolved if p["name"] == "torch"]
    assert torch["version"] == f"{TORCH}+cpu" and torch["url"].startswith(index), torch
    cuda = [p["name"] for p in resolved if p["name"].startswith(CUDA_PACKAGES)]
    assert cuda == [], cuda


# -- the command line ------------------------------------------------------------------------
def test_no_gpu_and_no_cpu_index_says_so_in_one_line_and_uses_the_configured_index():
    said, command = _printed(
        KVLEDGER_TORCH_CPU_INDEX="http://127.0.0.1:9/whl/cpu", KVLEDGER_TORCH_PROBE_TIMEOUT="2"
    )
    assert said == (
        "scripts/install-torch: no NVIDIA GPU, and PyTorch's CPU index "
        "http://127.0.0.1:9/whl/cpu did not answer within 2 s: torch==2.13.0 from pip's "
        "configured index (the CPU build only where that index or a local wheel has one; "
        "from PyPI alone it is the CUDA build, ~2.7 GB)"
    )
    assert command == [
        sys.executable,
        *("-m", "pip", "install", "-q", "--disable-pip-version-check"),
        f"torch=={TORCH}",
    ]


def test_the_default_cpu_index_is_pytorchs():
    said, command = _printed(KVLEDGER_TORCH_PROBE_TIMEOUT="5")
    if "--index-url" in command:
        assert command[command.index("--index-url") + 1] == CPU_INDEX
    else:
        assert f"PyTorch's CPU index {CPU_INDEX} did not answer" in said


def test_a_gpu_takes_the_configured_index_and_an_explicit_index_wins():
    said, command = _printed(KVLEDGER_TORCH_GPU="1")
    assert "an NVIDIA GPU is present" in said and "--index-url" not in command
    said, command = _printed(KVLEDGER_TORCH_INDEX="https://example.invalid/whl/cu130")
    assert command[-3:] == ["--index-url", "https://example.invalid/whl/cu130", f"torch=={TORCH}"]
    said, command = _printed(KVLEDGER_TORCH_INDEX="configured")
    assert "--index-url" not in command


def test_extra_pip_arguments_follow_the_pin_and_bad_timeouts_are_refused():
    r = _script("--print", sys.executable, "--no-warn-script-location", KVLEDGER_TORCH_GPU="1")
    assert shlex.split(r.stdout.splitlines()[1])[-2:] == [
        f"torch=={TORCH}",
        "--no-warn-script-location",
    ]
    r = _script("--print", sys.executable, KVLEDGER_TORCH_PROBE_TIMEOUT="5; rm -rf /")
    assert r.returncode == 2 and "expected seconds" in r.stderr
    assert _script().returncode == 2


def test_the_scripts_install_torch_through_it():
    for name in ("setup-venv", "test-sglang"):
        text = (ROOT / "scripts" / name).read_text()
        assert "scripts/install-torch " in text, name
        assert "pip install torch" not in text and '"torch==2.13.0"\n' not in text, name


# -- what the command resolves -------------------------------------------------------------
def _local_cpu_wheel() -> Path | None:
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    dirs = [d for d in os.environ.get("PIP_FIND_LINKS", "").split() if d]
    r = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    for line in r.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            dirs += value.strip("'\"").split()
    for d in dirs:
        for wheel in sorted(Path(d).glob(f"torch-{TORCH}+cpu-{tag}-{tag}-*.whl")):
            return wheel
    return None


class _CpuIndex:
    """A PEP 503 index on loopback listing one torch wheel, its core metadata beside it (PEP
    658/714, so a resolver needs no download); the wheel itself is served too, from disk."""

    def __init__(self, wheel: Path) -> None:
        with zipfile.ZipFile(wheel) as z:
            [name] = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
            metadata = z.read(name)
        digest = hashlib.sha256(metadata).hexdigest()
        page = (
            "<!DOCTYPE html><html><body>"
            f'<a href="/files/{quote(wheel.name)}" data-dist-info-metadata="sha256={digest}" '
            f'data-core-metadata="sha256={digest}">{wheel.name}</a></body></html>'
        ).encode()
        files = {"/torch/": page, f"/files/{wheel.name}.metadata": metadata}
        self.wheel_requests = 0
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.path = unquote(self.path)
                if self.path == f"/files/{wheel.name}":
                    index.wheel_requests += 1
                    body = wheel.read_bytes()
                else:
                    body = files.get(self.path, b"")
                    if not body:
                        self.send_error(404)
                        return
                self.send_response(200)
                kind = "text/html" if self.path.endswith("/") else "application/octet-stream"
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)


@pytest.fixture
def cpu_index() -> Iterator[_CpuIndex]:
    wheel = _local_cpu_wheel()
    if wheel is None:
        pytest.skip(f"no CPU wheel of torch {TORCH} for this Python on local disk")
    index = _CpuIndex(wheel)
    try:
        yield index
    finally:
        index.close()


@pytest.mark.slow
def test_a_cpu_index_that_answers_gives_the_cpu_build_even_beside_pypi(cpu_index, tmp_path):
    if not _reachable(f"{PYPI}/filelock/"):
        pytest.skip("PyPI is not reachable: torch's dependencies cannot be resolved")
    said, command = _printed(KVLEDGER_TORCH_CPU_INDEX=cpu_index.url)
    assert said == (
        f"scripts/install-torch: no NVIDIA GPU: torch=={TORCH}, the CPU build, from {cpu_index.url}"
    )
    assert command[-3:] == ["--index-url", cpu_index.url, f"torch=={TORCH}"]
    # PyPI beside it: its torch 2.13.0 is the CUDA build; the CPU one must still win
    resolved = _dry_run(command, tmp_path, "--extra-index-url", PYPI)
    _assert_cpu_only(resolved, cpu_index.url)
    # pip 23.2 resolves from the metadata, then still fetches the chosen wheel in a dry run:
    # from this loopback index, read from local disk (and ~10 MB of dependencies from PyPI)
    assert cpu_index.wheel_requests <= 1
    assert {p["name"] for p in resolved} >= {"torch", "filelock", "sympy", "networkx"}


@pytest.mark.slow
@pytest.mark.skipif(
    not _reachable(f"{CPU_INDEX}/torch/"), reason=f"{CPU_INDEX} is not reachable from here"
)
def test_pytorchs_cpu_index_gives_the_cpu_build(tmp_path):
    said, command = _printed()
    assert command[-3:] == ["--index-url", CPU_INDEX, f"torch=={TORCH}"], said
    _assert_cpu_only(_dry_run(command, tmp_path), CPU_INDEX)
