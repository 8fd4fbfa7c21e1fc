"""On a GPU: NVML's `used` moves by exactly the pool's physical bytes (live handles, mapped or
kept) through a churn run, and returns to its baseline after close()."""

from __future__ import annotations

import random

import pytest

from accounting import Ledger
from accounting.buffers import BufferSpec, Owner
from accounting.nvml import nvml_truth, used_bytes
from allocator import BackgroundMapper, SlotLayout, SwaPool

pytestmark = pytest.mark.gpu

LAYERS = 8


def _account(ledger: Ledger, layout: SlotLayout):
    specs = [
        BufferSpec(
            f"swa_kv.L{i}",
            "swa_kv",
            "swa",
            Owner.VMM,
            i,
            "uint8",
            (layout.rows, layout.row_bytes),
            layout.slot_bytes,
            layout.capacity_slots - 1,
            layout.buffer_bytes,
            layout.reserved_bytes,
        )
        for i in range(LAYERS)
    ]
    return ledger.add_account(specs, page_bytes=layout.page_bytes)


@pytest.mark.parametrize("mapper", [False, True], ids=["sync", "background"])
def test_nvml_used_delta_equals_physical_bytes_through_churn(mapper: bool) -> None:
    import torch

    from allocator.cuda import CudaBackend

    torch.cuda.init()
    # Load torch's kernels before the baseline: the first launch maps modules NVML counts as used.
    (torch.arange(1024, device="cuda").view(torch.uint8).float() * 2).sum().item()
    backend = CudaBackend(0)
    try:
        torch.cuda.synchronize()
        baseline = used_bytes(0)
        layout = SlotLayout(
            capacity_slots=200_000,
            slot_bytes=584,
            page_bytes=backend.granularity,
            slots_per_row=256,
            row_bytes=149_760,
        )
        ledger = Ledger({"tp_rank": "0"})
        account = _account(ledger, layout)
        ledger.add_truth(nvml_truth(0))
        rng = random.Random(7)
        held: list = []
        pool = SwaPool(
            backend,
            layers=LAYERS,
            layout=layout,
            observer=account,
            min_spare_pages=2 if mapper else 0,
            max_spare_pages=4,
            handle_pool_pages=3,
        )
        bg = BackgroundMapper(pool) if mapper else None
        checks = 0
        try:
            for step in range(60):
                if held and rng.random() < 0.4:
                    pool.free(held.pop(rng.randrange(len(held))))
                else:
                    held.append(pool.alloc(rng.choice([1, 17, 600, 4096, 9000])))
                if bg:
                    assert bg.wait_idle()
                physical = pool.stats()["physical_bytes"]
                snap = ledger.snapshot()
                assert snap.total("physical_bytes") == physical
                assert used_bytes(0) - baseline == physical, f"step {step}"
                (nvml,) = snap.reconciliation
                assert nvml["available"] and nvml["unattributed_bytes"] == 0, nvml
                checks += 1
            # write and read every occupied slot's bytes through an fp8 view of one layer
            ids = torch.cat(held)
            buf = pool.buffer(LAYERS - 1)
            for i in ids[:64].tolist():
                off = layout.slot_offset(i)
                buf.view(-1)[off : off + 584] = i % 251
            torch.cuda.synchronize()
            for i in ids[:64].tolist():
                off = layout.slot_offset(i)
                assert (
                    int(
                        buf.view(-1)[off : off + 584].view(torch.float8_e4m3fn).view(torch.uint8)[0]
                    )
                    == i % 251
                )
        finally:
            if bg:
                bg.close()
            pool.close()
        assert checks == 60
        assert ledger.snapshot().total("physical_bytes") == 0
        assert used_bytes(0) == baseline
        assert backend.stats()["handles"] == 0 and backend.stats()["mappings"] == 0
    finally:
        backend.close()
