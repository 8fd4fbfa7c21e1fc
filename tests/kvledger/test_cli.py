"""The `kvledger` command: version, top-level help, and subcommands imported only when used."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import kvledger
from kvledger import cli

ROOT = Path(__file__).resolve().parents[2]


def run(*code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "\n".join(code)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"kvledger {kvledger.__version__}\n"


def test_top_level_help_is_for_users(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "KV-cache memory" in out and "--version" in out
    for name, (_module, help_text) in cli.COMMANDS.items():
        assert name in out and help_text[:40] in " ".join(out.split())


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_only_the_command_used_is_imported(command):
    modules = {name: module for name, (module, _) in cli.COMMANDS.items()}
    r = run(
        "import sys",
        "from kvledger import cli",
        f"try: cli.main([{command!r}, '--help'])",
        "except SystemExit: pass",
        f"print(sorted(m for m in {sorted(modules.values())!r} if m in sys.modules))",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == repr([modules[command]])


def test_a_bad_option_is_one_line_exit_2():
    r = run("from kvledger import cli", "raise SystemExit(cli.main(['inspect', '--nope']))")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["kvledger: unrecognized arguments: --nope"]


FLASH = str(ROOT / "kvledger" / "data" / "deepseek-v4-flash-shape.config.json")


def _no_cuda() -> bool:
    from tests.conftest import cuda_available

    return not cuda_available()


# (argv, text the one line must contain). `serve`'s own table is in test_serve.py (a
# subprocess each: a serve that wrongly accepted its input would not return).
BAD_INPUTS = [
    (["nope"], "invalid choice: 'nope'"),
    (["--nope"], "required: COMMAND"),
    (["inspect", "--nope"], "unrecognized arguments: --nope"),
    (["inspect"], "--config is missing"),
    (["inspect", "--config", FLASH], "exactly one of --budget"),
    (["inspect", "--config", FLASH, "--budget", "-5GiB"], "--budget '-5GiB': negative"),
    (["inspect", "--config", FLASH, "--budget=-5GiB"], "--budget '-5GiB': negative"),
    (["inspect", "--config", FLASH, "--budget", "-.5GiB"], "--budget '-.5GiB': negative"),
    (["inspect", "--config", FLASH, "--budget", "lots"], "'lots'"),
    (["inspect", "--config", FLASH, "--budget", "1KiB"], "--budget 1024 is too small"),
    (["inspect", "--config", FLASH, "--budget", "1GiB", "--full-tokens", "9"], "not allowed"),
    (["inspect", "--config", FLASH, "--full-tokens", "-5"], "--full-tokens '-5'"),
    (["inspect", "--config", FLASH, "--full-tokens", "x"], "--full-tokens 'x'"),
    (
        ["inspect", "--config", FLASH, "--budget", "8GiB", "--max-running-requests", "0"],
        "--max-running-requests '0'",
    ),
    (
        ["inspect", "--config", FLASH, "--budget", "8GiB", "--swa-full-tokens-ratio", "2"],
        "--swa-full-tokens-ratio",
    ),
    (["inspect", "--config", FLASH, "--budget", "8GiB", "--state-dtype", "fp16"], "'fp16'"),
    (["inspect", "--config", "/dev/zero", "--budget", "1GiB"], "'/dev/zero': not a regular"),
    (["inspect", "--config", "/nonexistent/c.json", "--budget", "1GiB"], "no such file"),
    (["inspect", "--config", str(ROOT), "--budget", "1GiB"], "is a directory"),
    (["inspect", "--config", str(ROOT / "README.md"), "--budget", "1GiB"], "invalid JSON"),
    (["dashboards"], "one of the arguments --out --check is required"),
    (["dashboards", "--out", ""], "--out: '': expected a folder name"),
    (["dashboards", "--check", ""], "--check: '': expected a folder name"),
    (["dashboards", "--out", "a", "--check", "b"], "not allowed with"),
    (["dashboards", "--out", str(ROOT / "README.md")], "README.md: not a folder"),
    (["dashboards", "--out", str(ROOT / "README.md" / "sub")], "cannot write there"),
    (["dashboards", "--out", "/proc/kvledger-no-such/out"], "cannot write there"),
    (["bench"], "BENCHMARK"),
    (["bench", "nope"], "invalid choice: 'nope'"),
    (["bench", "alloc", "--page-repeats", "0"], "--page-repeats: '0'"),
    (["bench", "alloc", "--layers", "0"], "--layers: '0'"),
    (["bench", "alloc", "--layers", "x"], "--layers: 'x'"),
    (["bench", "alloc", "--capacity", "4096"], "--capacity: '4096'"),
    (["bench", "alloc", "--steps", "-1"], "--steps: '-1'"),
    (["bench", "alloc", "--backend", "tpu"], "'tpu'"),
    (["bench", "scrape", "--ranks", "0"], "--ranks: '0'"),
    (["bench", "scrape", "--budget", "-5GiB"], "--budget: '-5GiB': negative"),
    (["bench", "scrape", "--budget", "1KiB"], "--budget: '1KiB'"),
    (["bench", "scrape", "--parts", "nope"], "--parts: 'nope'"),
    (["bench", "scrape", "--batch", "0"], "--batch: '0'"),
    (["bench", "scrape", "--client-intervals", "-1"], "--client-intervals"),
    (["bench", "tp", "--layers", "0"], "--layers: '0'"),
    (["bench", "tp", "--page-mib", "0"], "--page-mib: '0'"),
    (["bench", "tp", "--warmup", "-1"], "--warmup: '-1'"),
    (["bench", "tp", "--timeout", "-1"], "--timeout: '-1'"),
    (["bench", "tp", "--timeout", "nan"], "--timeout: 'nan'"),
    (["bench", "sglang", "--requests", "0"], "--requests: '0'"),
    (["bench", "sglang", "--device", "tpu"], "'tpu'"),
]


def _case_id(argv: list[str]) -> str:
    return " ".join(argv).replace(str(ROOT) + "/", "").replace(str(ROOT), ".")


@pytest.mark.parametrize(("argv", "needle"), BAD_INPUTS, ids=[_case_id(a) for a, _ in BAD_INPUTS])
def test_every_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    """In this process: any exception other than the exit itself fails the test with its
    traceback, so passing means the command printed its one line and nothing else."""
    code: object
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvledger"), err
    assert needle in lines[0], lines[0]
    assert out == ""


@pytest.mark.skipif(not _no_cuda(), reason="a GPU is present: --backend cuda would run")
def test_bench_alloc_on_cuda_without_a_gpu_is_one_line(capsys):
    assert cli.main(["bench", "alloc", "--backend", "cuda"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("kvledger bench: --backend cuda") and len(err.splitlines()) == 1, err
    # the header line is printed only once a backend exists
    assert out == ""


def test_dashboards_out_empty_writes_nothing_into_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main(["dashboards", "--out", ""])
    assert e.value.code == 2
    assert list(tmp_path.iterdir()) == []


def test_python_m_kvledger_prints_no_traceback():
    """The same path through a real interpreter, for the cases named in the issue."""
    for argv in (
        ["bench", "alloc", "--page-repeats", "0"],
        ["inspect", "--budget", "-5GiB"],
        ["dashboards", "--out", str(ROOT / "README.md")],
    ):
        r = subprocess.run(
            [sys.executable, "-m", "kvledger", *argv],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
            check=False,
        )
        assert r.returncode == 2, (argv, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("argv", "joined"),
    [
        (["--budget", "-5GiB"], ["--budget=-5GiB"]),
        (["--budget", "-.5GiB", "--json"], ["--budget=-.5GiB", "--json"]),
        (["--seed", "-1"], ["--seed=-1"]),
        (["--json", "--budget", "-5GiB"], ["--json", "--budget=-5GiB"]),
        (["--budget", "5GiB"], ["--budget", "5GiB"]),
        (["--budget", "--json"], ["--budget", "--json"]),
        (["-x", "-5"], ["-x", "-5"]),
        (["--", "--budget", "-5GiB"], ["--", "--budget", "-5GiB"]),
        (["--budget"], ["--budget"]),
    ],
)
def test_join_negative_values(argv, joined):
    from kvledger.argtypes import join_negative_values

    assert join_negative_values(argv) == joined
