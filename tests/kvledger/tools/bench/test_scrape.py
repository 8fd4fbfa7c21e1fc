"""`kvledger bench scrape`'s command line: its options and every `--parts` value."""

from __future__ import annotations

import argparse

import pytest

from kvledger.cli import main
from kvledger.tools.bench import scrape
from kvledger.tools.bench.scrape_latency import bench_scrape


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvledger bench scrape")
    scrape.add_arguments(p)
    return p


def test_help_lists_every_option_and_part(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "scrape", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in ("--ranks", "--scrapes", "--clients", "--parts", "--multiprocess-mode"):
        assert option in out
    assert "scrape,concurrent,overhead,peer" in out


@pytest.mark.parametrize("part", scrape.PARTS)
def test_every_part_is_accepted_alone(part):
    assert _parser().parse_args(["--parts", part]).parts == (part,)


def test_parts_default_to_all_four_and_take_a_list():
    assert _parser().parse_args([]).parts == ("scrape", "concurrent", "overhead", "peer")
    assert _parser().parse_args(["--parts", "peer, scrape"]).parts == ("peer", "scrape")


def test_bench_scrape_stays_importable_from_here_for_scripts_scrape_ab():
    assert scrape.bench_scrape is bench_scrape
