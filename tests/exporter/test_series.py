"""exporter.series: a republished source's lines written under its previous layout."""

from __future__ import annotations

import dataclasses

from exporter.sources import Published, Scan, Sources
from tests.ledgers import small_ledger


def test_render_reuses_a_sources_layout_and_writes_what_a_fresh_render_writes():
    """A republished source's lines come from the layout of its previous snapshot while its
    series are the same; a snapshot with other series (labels, truth, accounts) gets its
    own. Either way the body equals what a collector that never saw the source writes."""
    from exporter import series as c
    from exporter.collector import KvLedgerCollector

    built = []
    real = c._layout

    def counting(shape, label_str):
        built.append(len(shape))
        return real(shape, label_str)

    with small_ledger() as sl:
        src = Sources()
        src.add_ledger(sl.ledger)
        [view] = src.read().views
        base = view.snapshot

        def version(snap, sequence):
            published = Published.from_snapshot(
                snap, source="s", pid=1, host="h", sequence=sequence
            )
            return Scan((dataclasses.replace(view, published=published),))

        sl.allocate(700)
        more = src.read().views[0].snapshot
        no_truth = dataclasses.replace(more, reconciliation=())
        relabelled = dataclasses.replace(more, labels={**more.labels, "tp_rank": "3"})
        steps = [base, more, base, no_truth, relabelled, more]
        collector = KvLedgerCollector(src)
        c._layout = counting
        try:
            for i, snap in enumerate(steps):
                scan = version(snap, i + 1)
                body, _ = collector.render("text/plain", scan)
                fresh, _ = KvLedgerCollector(src).render("text/plain", scan)
                assert body == fresh, i
        finally:
            c._layout = real
    # base and more share a layout; no_truth and relabelled each need one, then more again;
    # every fresh collector builds one (6)
    assert len(built) == 6 + 4, built
