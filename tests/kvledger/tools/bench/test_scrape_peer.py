"""`kvledger bench scrape --parts peer`: the render against prometheus-client, run small (no
timing asserted)."""

from __future__ import annotations

import json
import os

import pytest
from prometheus_client import values

from kvledger.cli import main
from kvledger.tools.bench.scrape_peer import PEER_VARIANTS, bench_peer, report_peer


def test_peer_renders_the_same_series_and_reports_positive_ratios():
    value_class = values.ValueClass
    env = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    p = bench_peer(ranks=2, budget=80 << 30, rounds=4)
    # The peers hold exactly kvledger's series: as many, with the same names and labels.
    assert p["series"] > 0
    assert p["generate_latest_series"] == p["multiprocess_series"] == p["series"]
    assert p["generate_latest_same_series"] and p["multiprocess_same_series"]
    assert p["multiprocess_files"] == 2  # one file per rank
    assert p["files_parsed_per_kvledger_render"] == 2  # every rank republished each round
    for name in PEER_VARIANTS:
        st = p[name]
        assert st["n"] == 4
        assert 0 < st["min_ms"] <= st["median_ms"] <= st["max_ms"]
    for peer in ("generate_latest", "multiprocess"):
        r = p[f"ratio_{peer}"]
        assert r["n"] == 4
        assert 0 < r["min"] <= r["median"] <= r["max"]
    assert p["target_ratio"] == 1.0 and isinstance(p["target_met"], bool)
    # prometheus-client's process-wide value class and the environment are as they were.
    assert values.ValueClass is value_class
    assert os.environ.get("PROMETHEUS_MULTIPROC_DIR") == env

    lines = report_peer(p)
    assert lines[0].startswith(f"render vs prometheus-client {p['prometheus_client']} (same ")
    assert "ratio kvledger/generate_latest" in lines[0]
    assert lines[-1].endswith(": met" if p["target_met"] else ": NOT met")


def test_peer_multiprocess_mode_all_adds_a_pid_label_not_a_series():
    p = bench_peer(ranks=2, budget=80 << 30, rounds=1, multiprocess_mode="all")
    assert p["multiprocess_series"] == p["series"]
    assert not p["multiprocess_same_series"]  # `all` labels every series with its pid
    with pytest.raises(ValueError, match="multiprocess_mode='bogus'"):
        bench_peer(ranks=1, budget=80 << 30, rounds=1, multiprocess_mode="bogus")


def test_bench_scrape_peer_part_alone_prints_and_reports_json(capsys):
    rc = main(["bench", "scrape", "--parts", "peer", "--ranks", "2", "--scrapes", "3", "--json"])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.startswith("render vs prometheus-client ")
    assert "target kvledger/generate_latest <= 1 (median of the paired ratios): " in out
    data = json.loads(out[out.index("\n{") :])
    assert set(data) == {"pid", "peer"}
    peer = data["peer"]
    assert peer["ranks"] == 2 and peer["rounds"] == 3
    assert peer["generate_latest_series"] == peer["multiprocess_series"] == peer["series"]
    for key in ("ratio_generate_latest", "ratio_multiprocess"):
        assert peer[key]["median"] > 0 and peer[key]["n"] == 3
