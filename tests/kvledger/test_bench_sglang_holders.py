"""kvledger.bench.sglang_holders runs on SGLang's own objects and reports side by side
(marker `sglang`)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.sglang


def test_the_holder_read_cost_is_measured_beside_a_decode_step() -> None:
    from kvledger.bench.sglang_holders import holders_cost, report

    r = holders_cost(layers=4, requests=4, rounds=3, steps=3)
    for key in ("decode_step", "holder_read", "core_read", "ratio", "core_ratio"):
        s = r[key]
        assert s["n"] == 3 and 0 < s["min"] <= s["median"] <= s["max"], key
    lines = report(r)
    ratio = next(line for line in lines if "read / step  median" in line)
    assert "(3 rounds)" in ratio and "target <= 1%" in ratio
