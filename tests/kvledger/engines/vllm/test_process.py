"""kvledger.engines.vllm.process: the engine core's publishes take the snapshot on the
caller's thread (after the refresh) and leave the encode and the write to the publisher's
thread; a worker's publish synchronously. No vLLM needed."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from accounting.buffers import BufferSpec, Owner
from accounting.ledger import Account, Ledger
from accounting.snapfile.format import parse, snapshot_of
from kvledger.engines.vllm.process import ProcessLedger


class _Part:
    """An engine's part: one slot account, set by `refresh` (vLLM's objects read there)."""

    def __init__(self, ledger: Ledger) -> None:
        spec = BufferSpec(
            name="kv_pool",
            family="kv_pool",
            pool="kv",
            owner=Owner.RUNTIME,
            layer=None,
            dtype="none",
            shape=(),
            slot_bytes=0,
            capacity_slots=100,
            tensor_bytes=0,
            reserved_bytes=0,
        )
        self.ledger = ledger
        self.account: Account = ledger.add_account([spec], key="kv/kv_pool")
        self.value = 0
        self.threads: list[int] = []

    def refresh(self) -> None:
        self.threads.append(threading.get_ident())
        self.account.on_slots(self.value, max(self.value, self.account.peak_occupied_slots))

    def close(self) -> None:
        self.account.on_slots(0, self.account.peak_occupied_slots)
        self.ledger.remove_account(self.account)


def _process(tmp_path: Any, role: str, **kw: Any) -> tuple[ProcessLedger, _Part]:
    pl = ProcessLedger(
        {"engine_type": role, "model_name": "m", "engine": "0"},
        directory=str(tmp_path),
        interval=1000.0,
        **kw,
    )
    part = _Part(pl.ledger)
    pl.add(part)
    return pl, part


def _occupied(path: str) -> int:
    with open(path, "rb") as f:
        envelope, rows = parse(f.read())
    return int(snapshot_of(envelope, rows).rollup("family")[("kv_pool",)]["occupied_slots"])


def _record_writes(pl: ProcessLedger) -> list[int]:
    assert pl.publisher is not None
    d = pl.publisher._dir
    real = d.write_replace
    seen: list[int] = []

    def write_replace(*args: Any, **kw: Any) -> Any:
        seen.append(threading.get_ident())
        return real(*args, **kw)

    d.write_replace = write_replace  # type: ignore[method-assign]
    return seen


def test_the_role_decides_who_writes(tmp_path) -> None:
    engine, _ = _process(tmp_path / "e", "vllm_scheduler")
    worker, _ = _process(tmp_path / "w", "vllm_worker")
    forced, _ = _process(tmp_path / "f", "vllm_worker", handoff=True)
    try:
        assert (engine.handoff, worker.handoff, forced.handoff) == (True, False, True)
    finally:
        for pl in (engine, worker, forced):
            pl.close()
    bad: Any = "yes"
    with pytest.raises(TypeError, match=r"ProcessLedger: handoff='yes', expected True"):
        ProcessLedger({}, directory=str(tmp_path), interval=1.0, handoff=bad)


def test_the_engine_core_refreshes_and_snapshots_here_and_writes_on_the_publishers_thread(
    tmp_path,
) -> None:
    pl, part = _process(tmp_path, "vllm_scheduler")
    try:
        pub = pl.publisher
        assert pub is not None
        writes = _record_writes(pl)
        taken: list[int] = []
        real_snapshot = pl.ledger.snapshot

        def snapshot(**kw: Any) -> Any:
            taken.append(threading.get_ident())
            return real_snapshot(**kw)

        pl.ledger.snapshot = snapshot  # type: ignore[method-assign]
        part.value = 7
        assert pl.publish_now(part.refresh)
        assert pl.publish_if_due(part.refresh) is False  # not due: nothing runs
        me = threading.get_ident()
        assert part.threads == [me] and taken == [me]  # refresh, then the snapshot, here
        deadline = time.monotonic() + 10
        while (pub.last_snapshot is None or pub.submitted != 1 or not writes) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.002)
        while _occupied(pub.path) != 7 and time.monotonic() < deadline:
            time.sleep(0.002)
        assert writes == [pub._thread.ident] and me not in writes
        assert _occupied(pub.path) == 7
        # Due again: the same, and the figures are the refresh's.
        pl._next = 0.0
        part.value = 9
        assert pl.publish_if_due(part.refresh)
        while _occupied(pub.path) != 9 and time.monotonic() < deadline:
            time.sleep(0.002)
        assert _occupied(pub.path) == 9 and writes == [pub._thread.ident] * 2
    finally:
        pl.close()


def test_a_worker_publishes_on_the_callers_thread(tmp_path) -> None:
    pl, part = _process(tmp_path, "vllm_worker")
    try:
        assert pl.publisher is not None
        writes = _record_writes(pl)
        part.value = 5
        assert pl.publish_now(part.refresh)
        assert writes == [threading.get_ident()]
        assert _occupied(pl.publisher.path) == 5  # written when publish_now returns
        assert pl.publisher.submitted == 0
    finally:
        pl.close()


def test_closing_with_a_snapshot_handed_over_leaves_nothing(tmp_path) -> None:
    fds, threads = len(os.listdir("/proc/self/fd")), set(threading.enumerate())
    for n in range(10):
        pl, part = _process(tmp_path, "vllm_scheduler")
        part.value = n
        pl.publish_now(part.refresh)
        pl.close()
        assert os.listdir(tmp_path) == [] and pl.publish_now(part.refresh) is False
    assert set(threading.enumerate()) == threads
    assert len(os.listdir("/proc/self/fd")) == fds
