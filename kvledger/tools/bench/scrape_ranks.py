"""The published ranks every part of `kvledger bench scrape` scrapes: one DeepSeek-V4-Flash
ledger per rank (8 ranks x 43 layers x 7 families by default), each rank's snapshot in its own
file as a publisher writes it, and a republish that replaces every rank's file."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from typing import Any

from accounting.buffers import Owner
from accounting.events import PoolEvent
from accounting.ledger import Ledger
from accounting.snapfile.directory import SnapshotDir
from accounting.snapfile.writer import Publisher
from kvledger.engines.sglang.dsv4 import Knobs, load_config, plan


def rank_ledger(rank: int, budget: int) -> Ledger:
    """A DeepSeek-V4-Flash-shaped ledger for one rank with every figure non-zero."""
    from kvledger.demo.source import default_config_path

    shape = load_config(default_config_path())
    bm = plan(shape, Knobs(), budget_bytes=budget)
    ledger = Ledger({"model_name": "deepseek-v4-flash", "tp_rank": str(rank)})
    by_family: dict[str, list[Any]] = {}
    for s in bm.specs(pool="dsv4", owner_of={"swa_kv": Owner.VMM}):
        by_family.setdefault(s.family, []).append(s)
    for family, specs in by_family.items():
        vmm = family == "swa_kv"
        acc = ledger.add_account(specs, page_bytes=2 << 20 if vmm else 0)
        if vmm:
            acc.on_pool_event(PoolEvent.HANDLES_CREATED, 12)
            for _ in range(12):
                acc.on_pool_event(PoolEvent.PAGES_MAPPED, 1, 0.0016)
            acc.on_pool_event(PoolEvent.PAGES_UNMAPPED, 2, 0.001)
        acc.occupy(min(acc.capacity_slots, 1000 + rank))
    return ledger


def _snapshot_versions(pub: Publisher, ledger: Ledger) -> tuple[bytes, bytes]:
    """Two different published files of one rank (the second one slot further on)."""
    versions = []
    for _ in range(2):
        pub.publish()
        with open(pub.path, "rb") as f:
            versions.append(f.read())
        next(a for a in ledger.accounts() if a.owner is Owner.RUNTIME).occupy(1)
    return versions[0], versions[1]


def _replace(path: str, data: bytes) -> None:
    """Write `data` to `path` the way a publisher does (accounting.snapfile.directory)."""
    with SnapshotDir(os.path.dirname(path), create=False) as d:
        d.write_replace(os.path.basename(path), data)


def rank_files(
    stack: contextlib.ExitStack, ranks: int, budget: int
) -> tuple[str, int, Callable[[], None]]:
    """(directory, buffers, republish) for `ranks` published ranks, closed by `stack`.

    "Republished" = every rank's file replaced by a different snapshot. The bench writes
    snapshots encoded beforehand (as a publisher would: a new file, renamed into place), so
    that building them (~2 ms a rank) does not load the machine between scrapes; what
    publishing costs the engine is the overhead part's business."""
    directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvledger-bench-"))
    ledgers = [rank_ledger(r, budget) for r in range(ranks)]
    pubs = [
        stack.enter_context(Publisher(led, directory, interval=3600, source=f"rank{r}"))
        for r, led in enumerate(ledgers)
    ]
    buffers = sum(len(led.snapshot().buffers) for led in ledgers)
    versions = [_snapshot_versions(pub, led) for pub, led in zip(pubs, ledgers, strict=True)]
    turn = [0]

    def republish() -> None:
        turn[0] ^= 1
        for pub, v in zip(pubs, versions, strict=True):
            _replace(pub.path, v[turn[0]])

    republish()
    return directory, buffers, republish
