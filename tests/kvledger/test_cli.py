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
