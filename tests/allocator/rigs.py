"""Helpers shared by the allocator tests: backends, the ledger account of a pool, a pool rig
whose `state()` captures everything observable (to prove a failed call changed nothing), and a
backend wrapper that fails a chosen call."""

from __future__ import annotations

from typing import Any

from accounting.buffers import BufferSpec, Owner
from accounting.ledger import Account, Ledger
from allocator.errors import DriverError
from allocator.host import HostBackend
from allocator.slots.layout import SlotLayout
from allocator.slots.pool import SwaPool

KIB = 1024
SMALL_GRANULARITY = 64 * KIB  # many pages per buffer on the host

# DeepSeek-V4's SWA layout: 584-byte slots, 256 per row, each row padded to a multiple of 576 B.
DSV4_SLOT_BYTES = 584
DSV4_SLOTS_PER_ROW = 256
DSV4_ROW_BYTES = 149760


def make_backend(kind: str, granularity: int | None = None) -> Any:
    if kind == "host":
        return HostBackend(granularity or SMALL_GRANULARITY)
    if kind == "cuda":
        from allocator.cuda import CudaBackend  # imported lazily: collection works without it

        return CudaBackend()
    raise ValueError(f"backend kind {kind!r}, expected 'host' or 'cuda'")


def pool_account(
    ledger: Ledger, layers: int, layout: SlotLayout, *, name: str = "swa", null_slot: bool = True
) -> Account:
    """The ledger account of a SwaPool: one VMM buffer per layer sharing one index space."""
    specs = [
        BufferSpec(
            name=f"{name}.layer{i}",
            family="swa_kv",
            pool=name,
            owner=Owner.VMM,
            layer=i,
            dtype="uint8",
            shape=(layout.rows, layout.row_bytes),
            slot_bytes=layout.slot_bytes,
            capacity_slots=layout.capacity_slots - int(null_slot),
            tensor_bytes=layout.buffer_bytes,
            reserved_bytes=layout.reserved_bytes,
        )
        for i in range(layers)
    ]
    return ledger.add_account(specs, page_bytes=layout.page_bytes)


class Rig:
    """A pool over a host backend, with its ledger; `state()` captures everything observable."""

    def __init__(
        self,
        backend: Any,
        *,
        layers: int,
        layout: SlotLayout,
        null_slot: bool = True,
        **pool_options: Any,
    ) -> None:
        self.backend = backend
        self.ledger = Ledger()
        self.account = pool_account(self.ledger, layers, layout, null_slot=null_slot)
        self.pool = SwaPool(
            backend,
            layers=layers,
            layout=layout,
            null_slot=null_slot,
            observer=self.account,
            **pool_options,
        )

    def state(self) -> dict[str, Any]:
        pages = self.pool.debug_state()
        snap = self.ledger.snapshot().to_dict()
        snap.pop("taken_at")
        snap.pop("epoch")
        for acc in snap["accounts"]:
            acc.pop("driver_failures_total")  # counted: asserted apart by the tests
        stats = self.pool.stats()
        stats.pop("driver_failures")  # a failure is counted: the one change a failed call makes
        out: dict[str, Any] = {"pool": pages, "stats": stats, "ledger": snap}
        if isinstance(self.backend, HostBackend):
            out["backend"] = self.backend.debug_state()
        elif hasattr(self.backend, "inner"):
            out["backend"] = self.backend.inner.debug_state()
        return out

    def close(self) -> None:
        self.pool.close()


class FailingBackend:
    """Wraps a backend and makes the k-th call (0-based) of operation `op` raise a DriverError
    before reaching the wrapped backend. `k=None` never fails; `calls` counts calls per op."""

    def __init__(self, inner: Any, op: str | None = None, k: int | None = None) -> None:
        self.inner = inner
        self.name = f"failing-{inner.name}"
        self.granularity = inner.granularity
        self.calls: dict[str, int] = {}
        self.arm(op, k)

    def arm(self, op: str | None, k: int | None) -> None:
        self.fail_op = op
        self.fail_at = k
        self.calls = {}

    def _count(self, op: str, address: int | None = None) -> None:
        n = self.calls.get(op, 0)
        self.calls[op] = n + 1
        if op == self.fail_op and n == self.fail_at:
            raise DriverError(op, "INJECTED_FAILURE", f"call {n} of {op}", address)

    def reserve(self, size: int) -> int:
        self._count("reserve")
        return int(self.inner.reserve(size))

    def free_reservation(self, address: int, size: int) -> None:
        self._count("free_reservation", address)
        self.inner.free_reservation(address, size)

    def create(self, size: int) -> int:
        self._count("create")
        return int(self.inner.create(size))

    def synchronize(self) -> None:
        self.inner.synchronize()

    def release(self, handle: int) -> None:
        self._count("release")
        self.inner.release(handle)

    def map(self, address: int, size: int, handle: int) -> None:
        self._count("map", address)
        self.inner.map(address, size, handle)

    def unmap(self, address: int, size: int) -> None:
        self._count("unmap", address)
        self.inner.unmap(address, size)

    def set_access(self, address: int, size: int) -> None:
        self._count("set_access", address)
        self.inner.set_access(address, size)

    def byte_tensor(self, address: int, size: int) -> Any:
        return self.inner.byte_tensor(address, size)

    def close(self) -> None:
        self.inner.close()
