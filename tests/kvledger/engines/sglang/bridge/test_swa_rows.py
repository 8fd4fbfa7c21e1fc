"""The bridged swa_kv rows: RowFollower on a page store on the host backend, with SGLang's DSV4
SWA geometry, reporting rows to an account that counts tokens (`slots_per_count`, as the
bridge registers it; no sglang)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from accounting.buffers import BufferSpec, Owner
from accounting.ledger import Ledger
from accounting.reconcile import host_memfd_truth
from allocator.host import HostBackend
from allocator.rows import RowFollower
from allocator.slots.layout import SlotLayout
from allocator.store import PageStore
from kvledger.engines.sglang.bridge.compat import V4_TOKEN_BYTES, expected_row_bytes
from tests.kvledger.engines.sglang.bridge.fakes import row_pages

PAGE_TOKENS = 256
ROW = expected_row_bytes(PAGE_TOKENS)  # 149,760
GRAN = 48 * 4096
ROWS = 9  # SGLang: 8 pages handed out + padding page 0
LAYERS = 3


class Rig:
    def __init__(self, **pool_options: object) -> None:
        self.backend = HostBackend(granularity=GRAN)
        self.layout = SlotLayout(capacity_slots=ROWS, slot_bytes=ROW, page_bytes=GRAN)
        self.ledger = Ledger()
        specs = [
            BufferSpec(
                name=f"swa_kv.L{i}",
                family="swa_kv",
                pool="dsv4",
                owner=Owner.VMM,
                layer=i,
                dtype="uint8",
                shape=(ROWS, ROW),
                slot_bytes=V4_TOKEN_BYTES,
                capacity_slots=ROWS * PAGE_TOKENS,
                tensor_bytes=ROWS * ROW,
                reserved_bytes=self.layout.reserved_bytes,
            )
            for i in range(LAYERS)
        ]
        self.account = self.ledger.add_account(
            specs, page_bytes=GRAN, capacity_slots=ROWS * PAGE_TOKENS, slots_per_count=PAGE_TOKENS
        )
        self.ledger.add_truth(host_memfd_truth(self.backend.physical_bytes, None))  # no mapper
        self.pool = PageStore(
            self.backend,
            layers=LAYERS,
            page_bytes=GRAN,
            num_pages=self.layout.num_pages,
            observer=self.account,
            **pool_options,  # type: ignore[arg-type]
        )
        self.follower = RowFollower(self.pool, rows=ROWS, row_bytes=ROW)

    def mapped(self) -> set[int]:
        return {p for p in range(self.layout.num_pages) if self.pool.is_mapped(p)}

    def held(self) -> list[int]:
        return self.follower.held().tolist()

    def close(self) -> None:
        self.pool.close()
        self.backend.close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig(max_spare_pages=0, handle_pool_pages=0)
    yield r
    r.close()


def test_row_zero_is_the_padding_page(rig: Rig) -> None:
    assert rig.mapped() == row_pages(0) == {0}
    assert rig.follower.held_rows == 0
    snap = rig.ledger.snapshot()
    assert snap.total("occupied_slots") == 0
    assert snap.total("physical_bytes") == GRAN * LAYERS == rig.backend.physical_bytes()


def test_take_maps_the_rows_pages_and_counts_tokens(rig: Rig) -> None:
    assert rig.follower.take([3, 5]) == 2
    assert rig.held() == [3, 5]
    assert rig.mapped() == row_pages(0) | row_pages(3) | row_pages(5)
    snap = rig.ledger.snapshot()
    assert snap.violations == ()
    assert snap.total("occupied_slots") == 2 * PAGE_TOKENS
    assert snap.total("occupied_bytes") == 2 * PAGE_TOKENS * V4_TOKEN_BYTES * LAYERS
    assert snap.total("mapped_bytes") == len(rig.mapped()) * GRAN * LAYERS
    (rec,) = snap.reconciliation
    assert rec["device_bytes"] == snap.total("physical_bytes") and rec["unattributed_bytes"] == 0


def test_give_back_unmaps_what_empties(rig: Rig) -> None:
    rig.follower.take([1, 2, 3])
    assert rig.follower.give_back([2]) == 1
    assert rig.mapped() == row_pages(0) | row_pages(1) | row_pages(3)
    assert rig.follower.give_back([1, 3]) == 2
    assert rig.mapped() == {0}
    snap = rig.ledger.snapshot()
    assert snap.total("occupied_slots") == 0
    assert snap.total("physical_bytes") == GRAN * LAYERS == rig.backend.physical_bytes()


def test_give_back_all(rig: Rig) -> None:
    rig.follower.take([1, 4, 8])
    assert rig.follower.give_back_all() == 3
    assert rig.follower.held_rows == 0 and rig.mapped() == {0}
    assert rig.follower.give_back_all() == 0


def test_disagreements_are_counted_and_not_applied(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.follower.take([2])
    epoch = rig.ledger.epoch
    assert rig.follower.take([2]) == 0  # already held
    assert rig.follower.give_back([4]) == 0  # never taken
    assert rig.follower.take([0, ROWS, -1]) == 0  # padding page and out of range
    assert rig.follower.take([6, 2]) == 1  # the held one is skipped, the other applied
    assert rig.follower.divergences == 6
    assert "disagree" in caplog.text
    assert rig.held() == [2, 6]
    assert rig.ledger.epoch > epoch
    with pytest.raises(TypeError, match="expected an int"):
        rig.follower.take(["3"])


def test_a_row_taken_twice_in_one_call_is_caught(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang never hands out a page twice in one call; if it did, a call of a few rows (the
    scalar path) applies it once and counts the divergence at once (a longer call is
    caught by the count check: tests/allocator/rows/test_follower.py), so the page still unmaps when
    the row goes back."""
    rig.follower.take([5, 5])
    assert rig.follower.divergences == 1
    assert "take of rows [5] skipped" in caplog.text
    assert rig.held() == [5] and rig.follower.held_rows == 1
    rig.follower.take([7])
    rig.follower.give_back([7])
    assert rig.ledger.snapshot().total("occupied_slots") == PAGE_TOKENS
    rig.follower.give_back([5])
    assert rig.mapped() == {0}


def test_spares_follow_the_pool_options() -> None:
    r = Rig()  # defaults: one spare page kept mapped, its handle set kept
    try:
        r.follower.take([1, 2])
        r.follower.give_back([1, 2])
        stats = r.pool.stats()
        assert stats["mapped_pages"] == 2  # the padding page and the one spare
        assert stats["occupied_slots"] == 0
        assert stats["spare_pages"] == 1 and stats["kept_handle_sets"] == 1
        snap = r.ledger.snapshot()
        assert snap.violations == ()
        assert snap.total("physical_bytes") == stats["physical_bytes"] == r.backend.physical_bytes()
    finally:
        r.close()


def test_close_releases_everything() -> None:
    r = Rig()
    r.follower.take([1, 7])
    r.close()
    r.close()
    assert r.backend.stats() == {
        "reservations": 0,
        "reserved_bytes": 0,
        "handles": 0,
        "handle_bytes": 0,
        "mappings": 0,
    }
    acc = r.ledger.accounts()[0]
    assert (acc.handle_pages, acc.mapped_pages, acc.occupied_slots) == (0, 0, 0)
    r.ledger.remove_account(acc)


def test_follower_refuses_bad_geometry() -> None:
    with HostBackend(granularity=GRAN) as be:
        layout = SlotLayout(capacity_slots=ROWS, slot_bytes=ROW, page_bytes=GRAN)
        with PageStore(be, layers=1, page_bytes=GRAN, num_pages=layout.num_pages) as store:
            with pytest.raises(ValueError, match="first_row"):
                RowFollower(store, rows=ROWS, row_bytes=ROW, first_row=0)
            with pytest.raises(ValueError, match="exceed"):
                RowFollower(store, rows=ROWS * 2, row_bytes=ROW)
            RowFollower(store, rows=ROWS, row_bytes=ROW)
            with pytest.raises(ValueError, match="already has a user"):
                RowFollower(store, rows=ROWS, row_bytes=ROW)
