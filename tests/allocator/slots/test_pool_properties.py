"""Property-based tests of SwaPool under random alloc / free / occupy traffic, with and without
the background mapper, against the kernel's truth (memfd blocks, mappings) and the ledger."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from accounting.buffers import runtime_buffer
from allocator.errors import CapacityError, DriverError, SlotError
from allocator.host import HostBackend
from allocator.mapper import BackgroundMapper
from allocator.slots.layout import SlotLayout
from allocator.states import PageState
from tests.allocator.rigs import (
    DSV4_ROW_BYTES,
    DSV4_SLOT_BYTES,
    DSV4_SLOTS_PER_ROW,
    KIB,
    SMALL_GRANULARITY,
    FailingBackend,
    Rig,
)

G = SMALL_GRANULARITY
LAYOUTS = {
    # 4 whole slots per page
    "plain": SlotLayout(capacity_slots=48, slot_bytes=16 * KIB, page_bytes=G),
    # DeepSeek-V4's padded rows: 584-byte slots, some straddling two pages
    "dsv4": SlotLayout(
        capacity_slots=2 * DSV4_SLOTS_PER_ROW,
        slot_bytes=DSV4_SLOT_BYTES,
        page_bytes=G,
        slots_per_row=DSV4_SLOTS_PER_ROW,
        row_bytes=DSV4_ROW_BYTES,
    ),
    # slots of 3/4 page: most straddle, and some pages hold nothing but a straddling slot
    "big": SlotLayout(capacity_slots=20, slot_bytes=48 * KIB, page_bytes=G),
    # two-granule pages, padded rows of three slots
    "rows": SlotLayout(
        capacity_slots=30,
        slot_bytes=40 * KIB,
        page_bytes=2 * G,
        slots_per_row=3,
        row_bytes=136 * KIB,
    ),
}


def _fds_of(file: tuple[int, int]) -> list[str]:
    """This process's fds open on `file` (st_dev, st_ino): other tests may hold backends."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            st = os.stat(f"/proc/self/fd/{fd}")
            if (st.st_dev, st.st_ino) == file:
                out.append(fd)
    return out


class PoolMachine(RuleBasedStateMachine):
    faulty = False

    def __init__(self) -> None:
        super().__init__()
        self.rig: Rig | None = None
        self.mapper: BackgroundMapper | None = None
        self.held: set[int] = set()

    @initialize(
        layout=st.sampled_from(sorted(LAYOUTS)),
        layers=st.integers(1, 3),
        null_slot=st.booleans(),
        max_spare=st.integers(0, 3),
        min_spare=st.integers(0, 3),
        handle_pool=st.one_of(st.none(), st.integers(0, 3)),
        budget_sets=st.one_of(st.none(), st.integers(1, 8)),
        background=st.booleans()
        if os.environ.get("KVL_BG") is None
        else st.just(os.environ["KVL_BG"] == "1"),
    )
    def start(
        self,
        layout: str,
        layers: int,
        null_slot: bool,
        max_spare: int,
        min_spare: int,
        handle_pool: int | None,
        budget_sets: int | None,
        background: bool,
    ) -> None:
        lay = LAYOUTS[layout]
        self.backend = HostBackend(G)
        memfd = self.backend.debug_state().memfd
        assert memfd is not None
        self.file: tuple[int, int] = memfd
        self.faults = FailingBackend(self.backend)  # armed only by FaultyPoolMachine.inject
        budget = None if budget_sets is None else budget_sets * layers * lay.page_bytes
        self.rig = Rig(
            self.faults,
            layers=layers,
            layout=lay,
            null_slot=null_slot,
            physical_budget=budget,
            min_spare_pages=min(min_spare, max_spare),
            max_spare_pages=max_spare,
            handle_pool_pages=handle_pool,
        )
        # a runtime-owned buffer beside the pool, so rollups have more than one key
        self.side = torch.zeros(16, 128, dtype=torch.bfloat16)
        self.side_account = self.rig.ledger.add_account(
            [runtime_buffer(self.side, name="c4.0", family="c4_kv", pool="c4", layer=0)]
        )
        if background:
            self.mapper = BackgroundMapper(self.rig.pool, idle_seconds=0.002, error_backoff=0.01)

    @property
    def pool(self) -> Any:
        assert self.rig is not None
        return self.rig.pool

    def _free_ids(self) -> list[int]:
        return [
            i
            for i in range(self.pool.layout.capacity_slots)
            if i not in self.held and i != self.pool.null_slot
        ]

    # -- rules ------------------------------------------------------------------------------
    @rule(n=st.integers(0, 40))
    def alloc(self, n: int) -> None:
        before = self._quiet_state()
        try:
            ids = self.pool.alloc(n).tolist()
        except (CapacityError, DriverError) as e:
            assert self.faulty or not isinstance(e, DriverError), e
            assert self._quiet_state() == before or self.mapper is not None
            assert set(self.pool.occupied_ids()) == self.held
            return
        assert len(ids) == n == len(set(ids))
        assert not set(ids) & self.held, "a slot was handed out twice"
        assert self.pool.null_slot not in ids
        self.held.update(ids)

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        # Neither draws nor preconditions depend on the state: with the mapper running, a
        # replay may take another path (a CapacityError or not), and hypothesis must not care.
        picks = data.draw(st.lists(st.integers(0, 1 << 16), min_size=1, max_size=40))
        if not self.held:
            return
        held = sorted(self.held)
        ids = sorted({held[k % len(held)] for k in picks})
        try:
            self.pool.free(torch.tensor(ids))
        except DriverError:  # a trim after the free failed; the free itself happened
            assert self.faulty
        self.held.difference_update(ids)
        assert set(self.pool.occupied_ids()) == self.held

    @rule(data=st.data())
    def occupy(self, data: st.DataObject) -> None:
        cap = self.pool.layout.capacity_slots
        picks = data.draw(st.lists(st.integers(0, 1 << 16), min_size=1, max_size=8))
        free = set(self._free_ids())
        ids = sorted({k % cap for k in picks} & free)
        if not ids:
            return
        before = self._quiet_state()
        try:
            self.pool.occupy(ids)
        except (CapacityError, DriverError) as e:
            assert self.faulty or not isinstance(e, DriverError), e
            assert self._quiet_state() == before or self.mapper is not None
            return
        self.held.update(ids)

    @rule(data=st.data())
    def bad_free(self, data: st.DataObject) -> None:
        cap = self.pool.layout.capacity_slots
        choices = [cap, -1, *self._free_ids()[:5]]
        if self.pool.null_slot is not None:
            choices.append(self.pool.null_slot)
        bad = choices[data.draw(st.integers(0, 1 << 16)) % len(choices)]
        good = sorted(self.held)[:2]
        before = self._quiet_state()
        try:
            self.pool.free([*good, bad])
        except SlotError:
            pass
        else:
            raise AssertionError(f"free of bad id {bad} did not raise")
        assert self._quiet_state() == before or self.mapper is not None
        assert set(self.pool.occupied_ids()) == self.held

    @precondition(lambda self: self.mapper is not None)
    @rule()
    def settle(self) -> None:
        assert self.mapper is not None
        assert self.mapper.wait_idle(timeout=10)
        with self.pool.store.lock:
            assert len(self.pool.store.spares) <= self.pool.max_spare_pages

    # -- invariants ---------------------------------------------------------------------------
    def _quiet_state(self) -> Any:
        if self.mapper is not None:
            return None
        assert self.rig is not None
        return self.rig.state()

    @invariant()
    def figures_agree_with_the_kernel_and_the_ledger(self) -> None:
        if self.rig is None:
            return
        pool, be, ledger = self.pool, self.backend, self.rig.ledger
        lay = pool.layout
        with pool.store.cond:
            assert pool.store.cond.wait_for(lambda: pool.store.busy == 0, timeout=10)
            books = pool.debug_state()
            occupied = {i for i in range(lay.capacity_slots) if books.occupied[i]}
            assert occupied - {pool.null_slot} == self.held
            # refcounts and tiers follow the occupied slots
            refs = [0] * lay.num_pages
            for i in occupied:
                for p in set(lay.slot_pages(i)):
                    refs[p] += 1
            assert list(books.refcount) == refs
            mapped = [p for p in range(lay.num_pages) if pool.store.state[p] == PageState.MAPPED]
            assert set(pool.store.spares) == {p for p in mapped if refs[p] == 0}, (
                "spare tier drifted"
            )
            # every page holding an occupied slot is mapped in every layer
            for p in {p for i in occupied for p in lay.slot_pages(i)}:
                assert pool.store.state[p] == PageState.MAPPED
                for layer in range(pool.layers):
                    assert be.is_mapped(pool.store.pages.address(layer, p)), (p, layer)
            for p in range(lay.num_pages):
                for layer in range(pool.layers):
                    assert be.is_mapped(pool.store.pages.address(layer, p)) == (p in mapped)
            if self.mapper is None and not self.faulty:  # a failed trim may leave extra spares
                assert len(pool.store.spares) <= pool.max_spare_pages
            # physical: memfd blocks == pool's live handle sets == ledger (kept sets included)
            set_bytes = pool.layers * lay.page_bytes
            physical = be.physical_bytes()
            assert physical == pool.store.live_sets * set_bytes
            assert be.stats()["handles"] == pool.store.live_sets * pool.layers
            assert pool.store.live_sets == len(mapped) + pool.store.kept_sets
            if pool.physical_budget is not None:
                assert physical <= pool.physical_budget
            assert be.stats()["mappings"] == len(mapped) * pool.layers
            snap = ledger.snapshot()
        vmm = snap.rollup("owner")[("vmm",)]
        assert vmm["physical_bytes"] == physical
        assert vmm["mapped_bytes"] == len(mapped) * set_bytes
        assert vmm["occupied_slots"] == len(self.held)
        assert snap.violations == ()

    @invariant()
    def rollups_are_sums_of_buffers(self) -> None:
        if self.rig is None:
            return
        snap = self.rig.ledger.snapshot()
        for keys in [(), ("family",), ("pool",), ("owner",), ("family", "owner")]:
            roll = snap.rollup(*keys)
            expect: dict[tuple[str, ...], dict[str, int]] = {}
            for row in snap.buffers:
                k = tuple(
                    str(getattr(row.spec, n).value if n == "owner" else getattr(row.spec, n))
                    for n in keys
                )
                sums = expect.setdefault(k, {})
                for name, value in row.figures().items():
                    if name not in ("occupied_slots", "capacity_slots"):
                        sums[name] = sums.get(name, 0) + value
            for acc in snap.accounts:
                k = tuple(
                    str(getattr(acc, n).value if n == "owner" else getattr(acc, n)) for n in keys
                )
                sums = expect[k]
                sums["occupied_slots"] = sums.get("occupied_slots", 0) + acc.occupied_slots
                sums["capacity_slots"] = sums.get("capacity_slots", 0) + acc.capacity_slots
            assert roll == expect

    def teardown(self) -> None:
        if self.rig is None:
            return
        self.faults.arm(None, None)
        ranges = [
            (b, b + self.pool.store.pages.reserved_bytes) for b in self.pool.store.pages.bases
        ]
        self.rig.close()
        assert self.mapper is None or not self.mapper.running
        snap = self.rig.ledger.snapshot()
        vmm = snap.rollup("owner")[("vmm",)]
        assert (vmm["physical_bytes"], vmm["mapped_bytes"], vmm["occupied_slots"]) == (0, 0, 0)
        assert self.backend.physical_bytes() == 0
        assert self.backend.stats() == {
            "reservations": 0,
            "reserved_bytes": 0,
            "handles": 0,
            "handle_bytes": 0,
            "mappings": 0,
        }
        self.backend.close()
        assert _fds_of(self.file) == []
        for line in Path("/proc/self/maps").read_text().splitlines():
            span, perms, _, _, inode = line.split()[:5]
            lo, hi = (int(x, 16) for x in span.split("-"))
            named = "kvledger-physical" in line
            assert not (named and int(inode) == self.file[1]), f"memfd still mapped: {line}"
            if perms == "---p":  # a reservation's signature (others may reuse the range)
                assert all(hi <= a or lo >= b for a, b in ranges), f"reservation left: {line}"


PoolMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolProperties = PoolMachine.TestCase


class FaultyPoolMachine(PoolMachine):
    """The same traffic with backend calls failing now and then (on the allocation path or the
    mapper's thread): every invariant above still holds after each failure."""

    faulty = True

    @rule(op=st.sampled_from(["create", "map", "set_access", "unmap"]), k=st.integers(0, 6))
    def inject(self, op: str, k: int) -> None:
        if self.rig is not None:
            self.faults.arm(op, k)


FaultyPoolMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestFaultyPoolProperties = FaultyPoolMachine.TestCase
