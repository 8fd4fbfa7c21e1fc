"""A small but real ledger for tests: an SWA account fed by a host-backed SwaPool plus runtime
accounts, closed by an ExitStack so every test proves release."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from accounting.buffers import runtime_buffer
from accounting.ledger import Account, Ledger
from accounting.reconcile import host_memfd_truth
from allocator import HostBackend, SlotLayout, SwaPool
from allocator.specs import vmm_layer_specs

PAGE = 2 << 20
SWA_SLOT = 584
SWA_ROW = 149_760  # 256 slots x 584 B padded to a multiple of 576 B


@dataclass
class SmallLedger:
    ledger: Ledger
    backend: HostBackend
    pool: SwaPool
    swa: Account
    c4: Account
    state: Account
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    _held: list = field(default_factory=list)

    def allocate(self, n: int) -> None:
        self._held.append(self.pool.alloc(n))

    def free_all(self) -> None:
        while self._held:
            self.pool.free(self._held.pop())

    def close(self) -> None:
        self.free_all()
        for acc in (self.c4, self.state):
            if acc.occupied_slots:
                acc.release(acc.occupied_slots)
        self._stack.close()

    def __enter__(self) -> SmallLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def small_ledger(
    labels: Mapping[str, str] | None = None, *, layers: int = 3, slots: int = 2048
) -> SmallLedger:
    stack = contextlib.ExitStack()
    ledger = Ledger(labels or {"model_name": "test-model", "tp_rank": "0"})
    backend = stack.enter_context(HostBackend())
    layout = SlotLayout(
        capacity_slots=slots,
        slot_bytes=SWA_SLOT,
        page_bytes=PAGE,
        slots_per_row=256,
        row_bytes=SWA_ROW,
    )
    specs = vmm_layer_specs(layout, layers, null_slot=False)
    swa = ledger.add_account(specs, page_bytes=PAGE, capacity_slots=slots - 1)
    ledger.add_truth(host_memfd_truth(backend.physical_bytes, None))  # no background mapper
    pool = stack.enter_context(
        SwaPool(backend, layers=layers, layout=layout, observer=swa, max_spare_pages=1)
    )
    c4_tensors = [torch.zeros(64, 584, dtype=torch.uint8) for _ in range(layers)]
    c4 = ledger.add_account(
        [
            runtime_buffer(t, name=f"c4_kv.{i}", family="c4_kv", pool="c4", layer=i)
            for i, t in enumerate(c4_tensors)
        ]
    )
    state = ledger.add_account(
        [
            runtime_buffer(
                torch.zeros(32, 2048, dtype=torch.float32),
                name="c4_attn_state.0",
                family="c4_attn_state",
                pool="c4_state",
                layer=0,
            )
        ]
    )
    return SmallLedger(ledger, backend, pool, swa, c4, state, stack)
