"""kvledger.tools.bench.sglang_holders runs on SGLang's own objects and reports side by side
(marker `sglang`)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.sglang


def test_the_holder_read_cost_is_measured_beside_a_decode_step() -> None:
    from kvledger.tools.bench.sglang_holders import holders_cost, report

    r = holders_cost(layers=4, requests=4, rounds=3, steps=3, publish_interval=2.0)
    for key in ("decode_step", "holder_read", "core_read", "ratio", "core_ratio", "share"):
        s = r[key]
        assert s["n"] == 3 and 0 < s["min"] <= s["median"] <= s["max"], key
    # the share is each round's read over the interval
    assert r["share"]["max"] == r["holder_read"]["max"] / 2.0
    lines = report(r)
    ratio = next(line for line in lines if "read / allocator step  median" in line)
    assert "(3 rounds)" in ratio and "target <= 1%" in ratio
    share = next(line for line in lines if "share of the engine's time" in line)
    assert "one read per 2 s publish interval" in share and "(3 rounds)" in share


def test_a_bad_publish_interval_is_refused_naming_it() -> None:
    from kvledger.tools.bench.sglang_holders import holders_cost

    with pytest.raises(ValueError, match=r"publish_interval=0.0, expected seconds > 0"):
        holders_cost(publish_interval=0.0)


def test_bench_sglang_runs_the_holders_part_alone(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from kvledger.tools.bench import sglang as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(
        ["--part", "holders", "--layers", "2", "--holders-requests", "3", "--holders-rounds",
         "2", "--holders-steps", "2", "--json"]
    )  # fmt: skip
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    assert "holders read vs decode step (cpu, 2 layers, 3 running requests" in out
    assert "bench sglang: SGLang" not in out  # the allocator cases did not run
