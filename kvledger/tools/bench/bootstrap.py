"""Paired ratios over rounds, their median and a bootstrap confidence interval for it.

A benchmark that times two engines round by round (the same work, back to back, the
order rotating) gets one ratio per round, `a[i] / b[i]`: whatever drifts between rounds on
a shared machine (other load, clock changes) hits both sides of a ratio alike. The
figure reported is the median of those ratios; its 95 % confidence interval is the
percentile bootstrap over rounds: `resamples` times, draw as many rounds as there are,
with replacement, and take the median of the draw; the interval is the 2.5th and 97.5th
percentiles of those medians. The draws come from numpy's PCG64 seeded with `seed`
(`SEED` by default), so the same rounds give the same interval on every run.

`Interval.verdict(target)` is how a target ("at most `target`") is judged: *met* only
when the whole interval is under it, *not met* when the whole interval is at or above
it, *not resolved* when it straddles it (more rounds, or a quieter machine, decide).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SEED = 20261202  # the default seed of the resampling (any fixed value; this one is documented)
RESAMPLES = 4000
LEVEL = 0.95
MET, NOT_MET, NOT_RESOLVED = "met", "not met", "not resolved"


@dataclass(frozen=True)
class Interval:
    """The median of `n` values and its bootstrap confidence interval [`low`, `high`] at
    `level`, from `resamples` draws seeded with `seed`."""

    median: float
    low: float
    high: float
    n: int
    level: float
    resamples: int
    seed: int

    @property
    def half_width(self) -> float:
        """The interval's larger side, relative to the median (0.02: within +-2 %)."""
        if self.median == 0:
            return math.inf
        return max(self.median - self.low, self.high - self.median) / abs(self.median)

    def within(self, rel: float) -> bool:
        """Whether the interval lies within +-`rel` of the median (to a rounding error)."""
        return self.half_width <= rel + 1e-12

    def verdict(self, target: float) -> str:
        """MET when the interval's upper end is under `target`, NOT_MET when its lower end
        is at or above it, NOT_RESOLVED otherwise."""
        if self.high < target:
            return MET
        if self.low >= target:
            return NOT_MET
        return NOT_RESOLVED

    def as_dict(self) -> dict[str, float | int]:
        return {
            "median": self.median,
            "low": self.low,
            "high": self.high,
            "n": self.n,
            "level": self.level,
            "resamples": self.resamples,
            "seed": self.seed,
            "half_width": self.half_width,
        }


def _check_values(name: str, values: Sequence[float]) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"{name}: {x.size} values, expected a non-empty sequence of numbers")
    if not np.all(np.isfinite(x)):
        raise ValueError(
            f"{name}: {float(x[~np.isfinite(x)][0])!r} among the values, expected finite"
        )
    return x


def ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """`num[i] / den[i]` for each round; both of one length, every value positive."""
    a, b = _check_values("num", num), _check_values("den", den)
    if a.size != b.size:
        raise ValueError(f"ratios: {a.size} numerators for {b.size} denominators, expected pairs")
    bad = np.flatnonzero((a <= 0) | (b <= 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"ratios: round {i} has {float(a[i])!r} / {float(b[i])!r}, expected positive times on both sides"
        )
    return (a / b).tolist()


def median_ci(
    values: Sequence[float],
    *,
    level: float = LEVEL,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> Interval:
    """The median of `values` and its percentile-bootstrap interval at `level`."""
    x = _check_values("values", values)
    if not 0 < level < 1:
        raise ValueError(f"level={level!r}, expected a number strictly between 0 and 1")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 100:
        raise ValueError(f"resamples={resamples!r}, expected an int >= 100")
    rng = np.random.Generator(np.random.PCG64(seed))
    n = x.size
    medians = np.empty(resamples)
    chunk = max(1, 1_000_000 // n)  # bounded memory: at most about 8 MB of draws at once
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        draws = x[rng.integers(0, n, size=(stop - start, n))]
        medians[start:stop] = np.median(draws, axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(medians, [tail, 1 - tail])
    return Interval(
        median=float(np.median(x)),
        low=float(low),
        high=float(high),
        n=n,
        level=level,
        resamples=resamples,
        seed=seed,
    )


def paired_ratio(
    num: Sequence[float],
    den: Sequence[float],
    *,
    level: float = LEVEL,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> Interval:
    """The median of the per-round ratios `num[i] / den[i]` and its bootstrap interval."""
    return median_ci(ratios(num, den), level=level, resamples=resamples, seed=seed)
