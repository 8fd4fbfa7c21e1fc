"""`kvledger bench sglang`: refuses cleanly without SGLang; with it, a small run of every case."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvledger.engines.sglang.bridge.bridge import DEFAULT_POOL_OPTIONS
from kvledger.tools.bench import bootstrap
from kvledger.tools.bench import sglang as bench

ROOT = Path(__file__).resolve().parents[4]
SMALL = [
    "--requests", "40", "--prompt", "300", "--decode-tokens", "16", "--layers", "2",
    "--swa-pages", "128", "--rounds", "3", "--max-rounds", "3", "--steps", "3", "--trips", "2",
    "--cycles", "3", "--max-cycles", "3", "--churn-events", "120", "--churn-round", "40",
    "--churn-warmup", "10",
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
    from kvledger.tools.bench.sglang_cases import shape_for

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
    from kvledger.tools.bench.sglang_cases import interval_of, run_all

    args = _args([*SMALL, "--churn-gap-ms", "5"])
    assert _args(SMALL).churn_gap_ms == 0  # back to back unless asked
    r = run_all(args, threads=1)
    # The pause after each churn event is not timed: 40 events a round would be 200 ms.
    assert r["config"]["churn_gap_ms"] == 5
    assert r["churn_event"]["native"]["median"] < 40 * 0.005
    for key in ("decode_step", "round_trip_4096", "fill_drain", "churn_event"):
        # whole rounds: 3 of each engine (--rounds = --max-rounds 3; churn: 120 / 40 events)
        assert r[key]["native"]["n"] == r[key]["control"]["n"] == r[key]["bridged"]["n"] == 3
        for variant in ("native", "control", "bridged"):
            s = r[key][variant]
            assert 0 < s["min"] <= s["median"] <= s["max"]
            assert s["min"] <= s["mean"] <= s["max"]
    for key, n in (("decode_step", 3 * 3), ("round_trip_4096", 3 * 2)):
        steps = r[key]["steps"]  # the steps inside the rounds, timed one by one too
        assert steps["native"]["n"] == steps["bridged"]["n"] == n
        # a round is all of its steps (and the replays at its end): never less than their sum
        assert r[key]["bridged"]["mean"] * 3 >= steps["bridged"]["mean"] * n * 0.999
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
    assert "(the resolution)" in "\n".join(bench.report(r))
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
    for target in (
        "decode step <= 1.03x",
        "4096-token alloc+release <= 1.05x",
        "fill/drain cycle <= 1.3x",
        "churn <= 1.3x",
    ):
        assert f"target {target} native: " in text
    assert "maps per cycle <= 1.10x fewest" in text
    # the ratios paired by round, with their bootstrap interval: one ratio per round
    for key in ("decode_step", "round_trip_4096", "fill_drain", "churn_event"):
        pr = r[key]["paired"]
        assert pr["rounds"] == 3
        for name in ("bridged", "control"):
            ci = pr[name]
            assert ci["n"] == 3 and ci["seed"] == bootstrap.SEED
            assert ci["min"] <= ci["low"] <= ci["median"] <= ci["high"] <= ci["max"]
        v = interval_of(r[key]).verdict(bench.TARGETS[key])
        assert f"{bench._verdict(v)} ({pr['bridged']['median']:.3f}x, 95% interval" in text
    assert text.count("bridged/native ") >= 4 and text.count("control/native ") >= 4
    assert r["churn"]["events"] == 120 and r["churn"]["round_events"] == 40
    if r["driver_waits"] is not None:  # per case too, read before and after each
        by_case = r["driver_waits_by_case"]
        assert list(by_case) == ["decode_step", "round_trip_4096", "fill_drain", "churn_event"]
        assert all(n >= 0 for n in by_case.values())
        assert sum(by_case.values()) <= r["driver_waits"]
        assert f"(decode_step {by_case['decode_step']}, round_trip_4096 " in text
    assert "churn mapped <= bound" in text
    assert "an untimed 5 ms pause after each event" in text
    if r["driver_waits"] is None:
        assert "waited on a driver call: n/a" in text
    else:
        assert f"({bench.COUNTER_DRIVER_WAITS}): {r['driver_waits']}" in text
        ok = "met" if r["driver_waits"] == 0 else "NOT met"
        assert f"target no allocation waits on a driver call: {ok}" in text  # on the CPU too


class _Bridge:
    """Stands in for a Bridge where run_rounds only lets its mapper finish."""

    def __init__(self) -> None:
        self.idles = 0

    def wait_idle(self) -> bool:
        self.idles += 1
        return True


def _variants() -> tuple[Any, ...]:
    from kvledger.tools.bench.sglang_cases import Variant

    return (
        Variant("native", None),  # type: ignore[arg-type]
        Variant("control", None),  # type: ignore[arg-type]
        Variant("bridged", None, _Bridge()),  # type: ignore[arg-type]
    )


def test_rounds_stop_once_the_interval_is_narrow_and_rotate_the_order() -> None:
    from kvledger.tools.bench.sglang_cases import run_rounds

    vs = _variants()
    order: list[tuple[int, str]] = []

    def one_round(v: Any, i: int) -> float:
        order.append((i, v.name))
        return (1.01 if v.name == "bridged" else 1.0) * (1 + 0.5 * (i % 3))  # drift, paired

    times = run_rounds(vs, one_round, least=10, most=200, width=0.02)
    assert [len(t) for t in times.values()] == [10, 10, 10]  # resolved at the least rounds
    assert [name for i, name in order if i == 0] == ["native", "control", "bridged"]
    assert [name for i, name in order if i == 1] == ["control", "bridged", "native"]
    assert [name for i, name in order if i == 2] == ["bridged", "native", "control"]
    assert vs[2].bridge.idles == 10  # the mapper let finish after each bridged round


def test_rounds_go_on_to_the_most_while_the_interval_is_wide() -> None:
    from kvledger.tools.bench.sglang_cases import CHECK_EVERY, paired, run_rounds

    def one_round(v: Any, i: int) -> float:
        return (0.5 + (i * 7919 % 100) / 100) if v.name == "bridged" else 1.0

    times = run_rounds(_variants(), one_round, least=10, most=10 + 3 * CHECK_EVERY, width=0.02)
    assert len(times["bridged"]) == 40
    pr = paired(times)
    assert pr["rounds"] == 40 and pr["bridged"]["half_width"] > 0.02
    assert pr["control"]["median"] == pr["control"]["low"] == pr["control"]["high"] == 1.0


def test_rounds_go_on_while_a_narrow_interval_straddles_the_target() -> None:
    from kvledger.tools.bench.sglang_cases import run_rounds

    def one_round(v: Any, i: int) -> float:
        return (1.02 + 0.02 * (i % 2)) if v.name == "bridged" else 1.0  # 1.02 / 1.04

    for target, rounds in ((1.03, 40), (1.05, 10), (1.01, 10)):
        times = run_rounds(_variants(), one_round, least=10, most=40, width=0.02, target=target)
        # within +-1 % from the start; decided against 1.05 (met) and 1.01 (not met) at
        # once, never against 1.03: on to the most
        assert len(times["bridged"]) == rounds, target


@pytest.mark.sglang
def test_churn_runs_the_policy_with_the_slack_the_environment_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """KVLEDGER_SGLANG_DSV4_COMPACT_SLACK reaches the bench's policy (the plugin's
    `CompactionPolicy.from_env`), and the report says what the samples were held to."""
    from kvledger.tools.bench.sglang_cases import apply_defaults, bench_churn, geometry_of, variants
    from kvledger.tools.bench.sglang_cases import bridged_of as bridged

    monkeypatch.setenv("KVLEDGER_SGLANG_DSV4_COMPACT_SLACK", "2")
    args = _args(SMALL)
    apply_defaults(args)
    with variants(args) as vs:
        ch = bench_churn(vs, args, geometry_of(bridged(vs)))
    assert ch["slack"] == 2
    assert "by more than 2 (the slack), back to the bound" in ch["compaction"]["describe"]
    assert 0 <= ch["over_slack"] <= ch["over"] <= ch["checked"]
    assert (ch["over_slack"] > 0) == (ch["excess_max"] > 2)
    line = bench.churn_bound_line(ch)
    assert f"samples over {ch['over']} of {ch['checked']}" in line
    said = "the policy's slack 2 (KVLEDGER_SGLANG_DSV4_COMPACT_SLACK): samples over bound + 2"
    assert f"{said} {ch['over_slack']}" in line
    assert "slack" not in bench.churn_bound_line({**ch, "slack": 0})
