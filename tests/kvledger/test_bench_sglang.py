"""`kvledger bench sglang`: refuses cleanly without SGLang; with it, a small run of every case."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from kvledger.bench import sglang as bench
from kvledger.sglang.bridge.bridge import DEFAULT_POOL_OPTIONS

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "--requests", "40", "--prompt", "300", "--decode-tokens", "16", "--layers", "2",
    "--swa-pages", "128", "--rounds", "3", "--steps", "3", "--trips", "2", "--cycles", "3",
    "--churn-events", "120", "--churn-warmup", "10",
]  # fmt: skip


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(argv)


def test_without_sglang_it_says_so_in_one_line_and_exits_2() -> None:
    code = (
        "import sys; sys.modules['sglang'] = None\n"  # import sglang -> ImportError
        "from kvledger.cli import main; sys.exit(main(['bench', 'sglang']))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs SGLang 0.5.23 importable" in lines[0]


def test_too_few_swa_pages_are_refused_naming_the_value() -> None:
    from kvledger.bench.sglang_cases import shape_for

    with pytest.raises(ValueError, match="--swa-pages=100"):
        shape_for(_args(["--swa-pages", "100"]))


@pytest.mark.sglang
def test_a_negative_spare_count_is_refused_naming_the_value(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench.run(_args(["--max-spare-pages", "-1"])) == 2
    assert "--max-spare-pages=-1, expected >= 0" in capsys.readouterr().err


@pytest.mark.sglang
def test_a_small_run_of_every_case(capsys: pytest.CaptureFixture[str]) -> None:
    from kvledger.bench.sglang_cases import run_all

    args = _args(SMALL)
    r = run_all(args, threads=1)
    for key, n in (
        ("decode_step", 3 * 3),
        ("round_trip_4096", 3 * 2),
        ("fill_drain", 3),
        ("churn_event", 120),
    ):
        assert r[key]["native"]["n"] == r[key]["control"]["n"] == r[key]["bridged"]["n"] == n
        for variant in ("native", "control", "bridged"):
            s = r[key][variant]
            assert 0 < s["min"] <= s["median"] <= s["max"]
            assert s["min"] <= s["mean"] <= s["max"]
    assert r["config"]["backend"] == "HostBackend"
    assert r["config"]["row_bytes"] == 149760
    cycles = r["fill_drain"]["cycles"]
    assert len(cycles) == 3
    for cycle in cycles:
        # Every VMM page a held row touched was mapped during the cycle or before it, and
        # touched pages hold at least the packed number of rows.
        assert cycle["maps"] >= cycle["fewest"] >= cycle["packed"] >= 0
        assert cycle["fewest"] > 0  # 80 rows held at the peak: 6 VMM pages, 2 mapped before
        assert cycle["unmaps"] >= 0
    ch = r["churn"]
    assert ch["admits"] + ch["finishes"] == 120
    assert "control/native (the resolution)" in "\n".join(bench.report(r))
    assert ch["checked"] == 120 - 10
    assert 0 <= ch["over"] <= ch["checked"]
    assert ch["mapped_max"] >= 1
    # The spare cap (docs/allocator.md): max_spare_pages (the bridge's default) + grace_pages (1).
    assert r["config"]["max_spare_pages"] == DEFAULT_POOL_OPTIONS["max_spare_pages"]
    assert 0 <= ch["spares_max"] <= r["config"]["max_spare_pages"] + 1
    assert ch["in_use_excess_max"] >= 0
    # The production compaction policy, one step per event; the memory it gives back.
    assert ch["compaction"]["compaction_steps"] == 120
    assert ch["compaction"]["compaction_rows_moved"] == ch["rows_moved"]
    mem = ch["swa_memory"]
    assert mem["samples"] == ch["checked"]
    for ratio in ("physical_per_occupied", "physical_per_native"):
        assert 0 < mem[ratio]["mean"] <= mem[ratio]["max"]
    assert "swa_kv physical / occupied: mean " in "\n".join(bench.report(r))
    assert "of which: spare page ids at most" in "\n".join(bench.report(r))
    lines = bench.report(r)
    text = "\n".join(lines)
    assert "targets:" in lines
    for target in ("decode step <=", "4096-token alloc+release <=", "fill/drain cycle <="):
        assert f"target {target}" in text
    assert "maps per cycle <= 1.10x fewest" in text
    # the targets' ratio, paired by round: one ratio per round (--rounds 3), one per cycle
    for key, rounds in (("decode_step", 3), ("round_trip_4096", 3), ("fill_drain", 3)):
        pr = r[key]["paired"]
        assert pr["rounds"] == rounds
        assert pr["bridged"]["min"] <= pr["bridged"]["median"] <= pr["bridged"]["max"]
    assert text.count("paired by round (") == 3
    if r["driver_waits"] is not None:  # per case too, read before and after each
        by_case = r["driver_waits_by_case"]
        assert list(by_case) == ["decode_step", "round_trip_4096", "fill_drain", "churn_event"]
        assert all(n >= 0 for n in by_case.values())
        assert sum(by_case.values()) <= r["driver_waits"]
        assert f"(decode_step {by_case['decode_step']}, round_trip_4096 " in text
    assert "churn mapped <= bound" in text
    if r["driver_waits"] is None:
        assert "waited on a driver call: n/a" in text
    else:
        assert f"({bench.COUNTER_DRIVER_WAITS}): {r['driver_waits']}" in text
