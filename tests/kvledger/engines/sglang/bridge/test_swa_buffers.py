"""kvledger.engines.sglang.bridge.swa_buffers: the ledger's specs of the bridged swa_kv buffers and
the native copy a detach puts back (no sglang)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from accounting.buffers import Owner
from allocator.host import HostBackend
from allocator.rows import RowFollower
from allocator.slots.layout import SlotLayout
from allocator.store import PageStore
from kvledger.engines.sglang.bridge.compat import V4_TOKEN_BYTES
from kvledger.engines.sglang.bridge.swa_buffers import FAMILY, native_copy, swa_specs
from tests.kvledger.engines.sglang.bridge.test_compat import GOOD  # 3 layers of SGLang's shape

PAGE_TOKENS = GOOD.page_tokens
ROW = GOOD.row_bytes
ROWS = GOOD.rows
GRAN = 48 * 4096


def test_specs_name_each_layer_from_the_pool_stage_and_own_the_vmm_layout() -> None:
    layout = SlotLayout(capacity_slots=ROWS, slot_bytes=ROW, page_bytes=GRAN, slots_per_row=1)
    specs = swa_specs(SimpleNamespace(_stage_start=3), GOOD, pool_name="p", layout=layout)
    assert [s.name for s in specs] == [f"{FAMILY}.L3", f"{FAMILY}.L4", f"{FAMILY}.L5"]
    for s in specs:
        assert s.owner is Owner.VMM and s.family == FAMILY and s.pool == "p"
        assert s.shape == (ROWS, ROW) and s.tensor_bytes == ROWS * ROW
        assert s.reserved_bytes == layout.reserved_bytes >= s.tensor_bytes
        assert s.capacity_slots == ROWS * PAGE_TOKENS and s.slot_bytes == V4_TOKEN_BYTES
    assert swa_specs(object(), GOOD, pool_name="p", layout=layout)[0].layer == 0


def test_the_native_copy_holds_the_padding_row_and_the_held_rows_only() -> None:
    with HostBackend(GRAN) as be:
        pages = -(-ROWS * ROW // GRAN)
        with PageStore(be, layers=1, page_bytes=GRAN, num_pages=pages) as store:
            f = RowFollower(store, rows=ROWS, row_bytes=ROW)
            f.take([2, 4])
            vmm = [torch.full((ROWS, ROW), 7 + i, dtype=torch.uint8) for i in range(GOOD.layers)]
            out = native_copy(vmm, f, GOOD)
    for i, t in enumerate(out):
        assert t.shape == (ROWS, ROW) and t.dtype == torch.uint8
        assert t is not vmm[i]
        for row in range(ROWS):
            want = 7 + i if row in (0, 2, 4) else 0
            assert bool((t[row] == want).all()), (i, row)
