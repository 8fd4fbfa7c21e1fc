"""The scale part's report (kvledger/tools/bench/scrape_scale.py): the departed-sources
verdict and, with several waves, whether what stays after one wave serves the next."""

from __future__ import annotations

from kvledger.tools.bench.scrape_scale import fit_line, report_scale


def _departed(afters: list[float], peaks: list[float]) -> dict:
    server = {"base_mib": 60.0, "peaks_mib": peaks, "afters_mib": afters}
    return {"sources": 1000, "cycles": len(afters), "servers": {"this tree": server}}


def test_one_wave_gives_the_verdict_and_no_wave_line() -> None:
    lines = report_scale({"departed": _departed([70.0], [90.0])})
    assert any("after/start 1.167  target <= 1.2: met" in line for line in lines)
    assert not any("waves" in line for line in lines)


def test_waves_report_each_peak_and_end_and_the_last_end_against_the_first() -> None:
    lines = report_scale({"departed": _departed([84.0, 84.0, 92.4], [96.0, 97.0, 98.0])})
    assert any("after/start 1.400  target <= 1.2: NOT met" in line for line in lines)
    (waves,) = [line for line in lines if "waves" in line]
    assert "peak 96.0 97.0 98.0 MiB, after 84.0 84.0 92.4" in waves
    assert waves.endswith("last after / first after 1.100")


def test_fit_line_is_exact_on_a_line() -> None:
    slope, intercept, worst = fit_line([1, 2, 4], [3.0, 5.0, 9.0])
    assert (round(slope, 9), round(intercept, 9), round(worst, 9)) == (2.0, 1.0, 0.0)
