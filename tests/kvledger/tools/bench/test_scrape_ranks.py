"""The published ranks `kvledger bench scrape` scrapes: one file per rank, republished whole."""

from __future__ import annotations

import contextlib
import os

from kvledger.tools.bench.scrape_ranks import rank_files, rank_ledger


def test_rank_ledger_is_labelled_with_its_rank():
    ledger = rank_ledger(3, 80 << 30)
    snap = ledger.snapshot()
    assert snap.buffers
    assert snap.labels["tp_rank"] == "3"


def test_republish_replaces_every_rank_file_with_another_snapshot():
    with contextlib.ExitStack() as stack:
        directory, buffers, republish = rank_files(stack, 2, 80 << 30)
        assert buffers > 0

        def contents() -> dict[str, bytes]:
            out = {}
            for name in sorted(os.listdir(directory)):
                with open(os.path.join(directory, name), "rb") as f:
                    out[name] = f.read()
            return out

        before = contents()
        assert len(before) == 2
        republish()
        after = contents()
        assert after.keys() == before.keys()
        assert all(after[n] != before[n] for n in before)
        republish()
        assert contents() == before  # two versions, taken in turn
    assert not os.path.exists(directory)
