"""kvledger.tools.bench.bootstrap: the paired ratio's median and its bootstrap interval."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvledger.tools.bench import bootstrap as bs


def test_the_interval_is_the_same_for_the_same_rounds_and_seed() -> None:
    x = np.random.default_rng(1).lognormal(0.0, 0.1, 50).tolist()
    a, b = bs.median_ci(x), bs.median_ci(x)
    assert a == b
    assert a.seed == bs.SEED and a.resamples == bs.RESAMPLES and a.level == bs.LEVEL
    other = bs.median_ci(x, seed=7)
    assert other != a  # another seed draws other resamples...
    assert abs(other.low - a.low) < 0.02 and abs(other.high - a.high) < 0.02  # ...alike


def test_a_known_distribution_median_lies_inside_a_narrow_interval() -> None:
    # Ratios log-normal around exp(0.05) = 1.0513, 10 % spread, 400 rounds: the median's
    # standard error is about 1.25 * 0.105 / 20 = 0.0066, so the 95 % interval is about +-1.3 %.
    true_median = math.exp(0.05)
    x = np.random.default_rng(3).lognormal(0.05, 0.1, 400).tolist()
    ci = bs.median_ci(x)
    assert ci.low < true_median < ci.high
    assert ci.low <= ci.median <= ci.high
    assert 0.006 < ci.half_width < 0.02
    assert ci.median == pytest.approx(float(np.median(x)))


def test_the_95_percent_interval_covers_the_true_median_about_95_percent_of_the_time() -> None:
    rng = np.random.default_rng(11)
    trials, covered = 300, 0
    for t in range(trials):
        x = rng.normal(1.0, 0.1, 41).tolist()  # true median 1.0
        ci = bs.median_ci(x, resamples=1000, seed=t)
        covered += ci.low <= 1.0 <= ci.high
    # Binomial(300, 0.95) lies in 0.91..0.98 with probability above 0.999; a percentile
    # bootstrap of a median of 41 is slightly conservative or slightly liberal, not far off.
    assert 0.90 <= covered / trials <= 0.99, covered


def test_an_interval_of_the_wrong_level_does_not_cover_as_95() -> None:
    rng = np.random.default_rng(12)
    covered = 0
    for t in range(200):
        x = rng.normal(1.0, 0.1, 41).tolist()
        ci = bs.median_ci(x, level=0.5, resamples=1000, seed=t)
        covered += ci.low <= 1.0 <= ci.high
    assert covered / 200 < 0.75  # the coverage test above can tell a 50 % interval apart


def test_paired_ratio_is_the_median_of_the_per_round_ratios() -> None:
    num = [2.0, 3.3, 4.2, 1.05, 10.0]
    den = [2.0, 3.0, 4.0, 1.0, 5.0]
    ci = bs.paired_ratio(num, den)
    assert ci.n == 5
    assert ci.median == pytest.approx(1.05)  # ratios 1.0, 1.1, 1.05, 1.05, 2.0
    assert ci.low >= 1.0 and ci.high <= 2.0
    assert bs.ratios(num, den) == pytest.approx([1.0, 1.1, 1.05, 1.05, 2.0])


def _iv(median: float, low: float, high: float) -> bs.Interval:
    return bs.Interval(median, low, high, n=10, level=0.95, resamples=1000, seed=0)


def test_a_target_is_met_only_when_the_whole_interval_is_under_it() -> None:
    assert _iv(1.00, 0.99, 1.02).verdict(1.03) == bs.MET
    assert _iv(1.02, 1.01, 1.03).verdict(1.03) == bs.NOT_RESOLVED  # upper end at the target
    assert _iv(1.02, 0.99, 1.05).verdict(1.03) == bs.NOT_RESOLVED
    assert _iv(1.05, 1.03, 1.07).verdict(1.03) == bs.NOT_MET
    assert _iv(1.00, 0.98, 1.01).half_width == pytest.approx(0.02)
    assert _iv(1.00, 0.98, 1.01).within(0.02) and not _iv(1.00, 0.97, 1.01).within(0.02)
    d = _iv(1.0, 0.9, 1.1).as_dict()
    assert d["median"] == 1.0 and d["half_width"] == pytest.approx(0.1) and d["n"] == 10


@pytest.mark.parametrize(
    ("num", "den", "match"),
    [
        ([1.0, 2.0], [1.0], "2 numerators for 1 denominators"),
        ([1.0, 0.0], [1.0, 1.0], r"round 1 has 0.0 / 1.0, expected positive"),
        ([1.0], [-2.0], r"round 0 has 1.0 / -2.0"),
        ([], [], "num: 0 values, expected a non-empty"),
        ([1.0, math.nan], [1.0, 1.0], "nan among the values, expected finite"),
    ],
)
def test_bad_rounds_are_refused_naming_the_value(
    num: list[float], den: list[float], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        bs.paired_ratio(num, den)


def test_bad_level_and_resamples_are_refused_naming_the_value() -> None:
    with pytest.raises(ValueError, match=r"level=1\.0, expected"):
        bs.median_ci([1.0, 2.0], level=1.0)
    with pytest.raises(ValueError, match="resamples=10, expected an int >= 100"):
        bs.median_ci([1.0, 2.0], resamples=10)
