"""A wheel install (`pip install .`, not editable) in a fresh venv, as README's "Install" says:
torch first (here the CPU 2.13.0 wheel from local disk), then kvledger. It must give a working
`kvledger --version` and `kvledger dashboards --out DIR` (the dashboards come from package data,
not from the source tree)."""

from __future__ import annotations

import os
import subprocess
import venv
from pathlib import Path

import pytest

import kvledger

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


def test_pip_install_gives_a_working_command(tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    pip = (py, "-m", "pip", "install", "-q", "--disable-pip-version-check")
    r = _run(*pip, "torch==2.13.0", cwd=tmp_path)
    if r.returncode:
        pytest.skip(f"torch 2.13.0 not installable here (no local wheel?): {r.stderr[-300:]}")
    # a copy of the tree, so the build leaves nothing in the checkout
    src = tmp_path / "src"
    r = _run("git", "-C", ROOT, "ls-files", "-z", cwd=tmp_path)
    for rel in r.stdout.split("\0"):
        if rel and (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes((ROOT / rel).read_bytes())
    r = _run(*pip, src, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]

    # run from an unrelated folder: nothing may come from the checkout
    work = tmp_path / "work"
    work.mkdir()
    exe = env_dir / "bin" / "kvledger"
    r = _run(exe, "--version", cwd=work)
    assert (r.returncode, r.stdout) == (0, f"kvledger {kvledger.__version__}\n"), r.stderr
    r = _run(py, "-c", "import kvledger, sys; print(kvledger.__file__)", cwd=work)
    assert "site-packages" in r.stdout, r.stdout
    out = work / "dashboards"
    r = _run(exe, "dashboards", "--out", out, cwd=work)
    assert r.returncode == 0, r.stderr
    for rel in (
        "README.md",
        "grafana/dashboards/kvledger-kv-cache.json",
        "grafana/provisioning/datasources/kvledger.yml",
        "prometheus/prometheus.yml",
        "prometheus/alerts.yml",
        "prometheus/tests/alerts_test.yml",
    ):
        assert (out / rel).is_file(), rel
    # the same files as the repository's generated copy
    for path in out.rglob("*"):
        if path.is_file():
            assert path.read_bytes() == (ROOT / "dashboards" / path.relative_to(out)).read_bytes()
    r = _run(exe, "dashboards", "--check", out, cwd=work)
    assert (r.returncode, r.stdout) == (0, "")
    for command in ("serve", "inspect", "dashboards", "bench"):
        r = _run(exe, command, "--help", cwd=work)
        assert r.returncode == 0 and "options:" in r.stdout, (command, r.stderr)
