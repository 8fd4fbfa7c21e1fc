"""`kvledger bench sglang --part serving`: a tiny run, every field reported."""

from __future__ import annotations

import argparse

import pytest

from kvledger.tools.bench import sglang as bench
from kvledger.tools.bench import sglang_serving as serving

TINY = [
    "--part", "serving", "--layers", "2", "--serving-rounds", "2", "--serving-steps", "15",
    "--serving-forward-ms", "2", "--serving-compaction", "0,off", "--serving-rate", "0.5",
    "--serving-prompt-median", "300", "--serving-output-median", "12",
    "--serving-swa-pages", "256", "--serving-full-pages", "1024",
]  # fmt: skip


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(argv)


@pytest.mark.sglang
def test_a_tiny_serving_run_reports_every_field_and_the_same_tokens() -> None:
    args = _args(TINY)
    bench.cases.apply_defaults(args)
    r = serving.run_serving(args)
    assert r["config"]["device"] == "cpu" and r["config"]["trace"].startswith("lognormal-chat")
    runs = r["runs"]
    assert [(x["forward_ms"], x["compaction"]) for x in runs] == [(2.0, "slack 0"), (2.0, "off")]
    for run in runs:
        assert run["same_tokens"] is True and run["tokens"] > 0
        for name in ("tokens_per_s", "steps_per_s"):
            ci = run["paired"][name]
            assert ci["n"] == 2 and ci["low"] <= ci["median"] <= ci["high"]
        for k in ("native", "bridged"):
            v = run[k]
            assert v["host_us"]["n"] == 2 * 15
            assert v["blocked_us"]["median"] >= 0 and v["waits_per_1000_steps"] >= 0
            assert v["loop_wait_ms"] >= 0
        assert run["native"]["waits_per_1000_steps"] == 0  # native SGLang makes none here
        assert run["swa_memory"]["samples"] == 2 * 15
        assert 0 < run["swa_memory"]["physical_per_native"]["mean"] <= 1.5
        assert run["bound"]["samples"] == 2 * 15
        assert "compactions_per_1000_steps" in run["bridged"]
    off = runs[1]
    assert off["bridged"]["rows_moved"] == 0 and off["bridged"]["waits_per_1000_steps"] == 0
    lines = serving.report(r)
    assert any("same tokens native/bridged: True" in x for x in lines)


@pytest.mark.sglang
def test_the_control_runs_native_twice_and_reports_its_spread() -> None:
    args = _args([*TINY, "--serving-control", "--serving-compaction", "off"])
    bench.cases.apply_defaults(args)
    r = serving.run_serving(args)
    assert r["config"]["control"] is True
    (run,) = r["runs"]
    assert run["same_tokens"] is True  # the control ran the same trace, token for token
    cc = run["paired"]["control_tokens_per_s"]
    assert cc["n"] == 2 and cc["low"] <= cc["median"] <= cc["high"]
    assert run["control"]["host_us"]["n"] == 2 * 15
    assert any("control native/native" in x for x in serving.report(r))


@pytest.mark.sglang
def test_the_host_proof_finds_no_wait_but_detach_s_drain(capsys: pytest.CaptureFixture) -> None:
    """The proof on the host model (a forward held in flight until each path ends): every
    bridged path but detach waits for nothing; detach waits once, for the page store's
    drain before it unmaps (by design), and says so instead of "ok"; exit 0."""
    from kvledger.tools.bench import sglang_proof as proof

    r = proof.sync_proof("cpu", 20.0)
    for path in proof.PROOF_PATHS:
        if path not in proof.WAITS_BY_DESIGN:
            assert r["bridged"][path] == "ok", (path, r)
        assert r["native"][path] in ("ok", "n/a"), (path, r)
    assert r["bridged"]["detach"] == "1 waits ({'device drain': 1})", r
    assert proof.main(["proof"]) == 0
    assert "waits by design" in capsys.readouterr().out
