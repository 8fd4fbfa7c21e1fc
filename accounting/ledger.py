"""The ledger: accounts of buffers, updated O(1) per allocator event, snapshotted whole.

An `Account` is one index space and the layer buffers that share it (the SWA
pool of all layers, the C4 rows of all ratio-4 layers, ...). The allocator of
that space reports events to its account; per-buffer figures are derived from
the account's counters and the buffer's static sizes, and every rollup is a sum
over buffers (bytes) or accounts (slots) taken inside one snapshot. No rollup is
a counter of its own, so none can drift.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from accounting.buffers import BufferSpec, Owner
from accounting.engine_state import EngineState
from accounting.events import PoolEvent
from accounting.request_slots import RequestSlots
from accounting.rows import AccountRow, BufferRow
from accounting.snapshot import Snapshot
from accounting.tp_status import TpStatus

_SLOTS_OCCUPIED = PoolEvent.SLOTS_OCCUPIED
_SLOTS_FREED = PoolEvent.SLOTS_FREED

# Upper bounds (seconds) of the map-latency histogram buckets for one page id. A map
# operation of n page ids took t seconds: each of its n page ids observes t / n, so the
# buckets count page ids (they add up to pages_mapped_total) and the observations add up to
# map_seconds_total, the histogram's _count and _sum (exporter.collector).
MAP_SECONDS_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
)


class LedgerError(RuntimeError):
    """A figure would go negative or past its bound: a bug in whoever reported it."""


class Account:
    """Counters of one index space. Implements `accounting.PoolObserver`.

    `slots_per_count`: the slots one reported unit stands for. Every slot count reported to
    the account (`on_pool_event`'s SLOTS_OCCUPIED / SLOTS_FREED, `on_slots`, `occupy`,
    `release`) is multiplied by it; page and handle counts are not. An allocator that hands
    out rows of several slots (an engine page of `page_size` tokens followed by
    allocator.rows' `RowFollower`) reports rows and the account counts slots. 1 by default.
    """

    def __init__(
        self,
        ledger: Ledger,
        *,
        key: str,
        family: str,
        pool: str,
        owner: Owner,
        buffers: tuple[BufferSpec, ...],
        page_bytes: int,
        capacity_slots: int,
        slots_per_count: int = 1,
    ) -> None:
        if (
            isinstance(slots_per_count, bool)
            or not isinstance(slots_per_count, int)
            or slots_per_count <= 0
        ):
            raise ValueError(
                f"account {key!r}: slots_per_count={slots_per_count!r}, expected a positive int"
            )
        self._ledger = ledger
        self.key = key
        self.family = family
        self.pool = pool
        self.owner = owner
        self.buffers = buffers
        self.page_bytes = page_bytes
        self.capacity_slots = capacity_slots
        self.slots_per_count = slots_per_count
        self.handle_pages = 0
        self.mapped_pages = 0
        self._occupied_slots = 0  # read it through `occupied_slots` (flushes the allocator)
        self.peak_occupied_slots = 0
        self.peak_handle_pages = 0
        self.pages_mapped_total = 0
        self.pages_unmapped_total = 0
        self.map_seconds_total = 0.0
        self.unmap_seconds_total = 0.0
        self.driver_failures_total = 0
        self.map_calls = 0
        self.map_bucket_counts = [0] * (len(MAP_SECONDS_BUCKETS) + 1)
        self._flush: Callable[[], None] | None = None  # the attached allocator's, if any
        # (tree_protected, tree_evictable) as a holder reader last set them; None: unread
        self._tree_held: tuple[int, int] | None = None
        self.evicted_slots_total = 0
        self.window_evicted_slots_total = 0

    @property
    def reported(self) -> bool:
        """Whether an attached allocator reports this account's slots (`attach`)."""
        return self._flush is not None

    @property
    def occupied_slots(self) -> int:
        """Slots held now (an attached allocator reports its count first). Not to be read
        under the ledger's lock: the allocator's lock comes first."""
        flush = self._flush
        if flush is not None:
            flush()
        return self._occupied_slots

    # -- PoolObserver ---------------------------------------------------------
    def on_pool_event(self, event: PoolEvent, count: int, seconds: float = 0.0) -> None:
        if count < 0:
            raise LedgerError(f"account {self.key!r}: {event.value} count={count}, expected >= 0")
        ledger = self._ledger
        if event is _SLOTS_OCCUPIED or event is _SLOTS_FREED:
            # Reported one change at a time (runtime-owned buffers): kept to the arithmetic.
            count *= self.slots_per_count
            with ledger._lock:
                value = self._occupied_slots + (count if event is _SLOTS_OCCUPIED else -count)
                if value < 0 or value > self.capacity_slots:
                    self._set_occupied(value, event)  # raises, naming the bound
                self._occupied_slots = value
                if value > self.peak_occupied_slots:
                    self.peak_occupied_slots = value
                ledger._epoch += 1
            if ledger._event_hook is not None:
                ledger._after_event()
            return
        # Page events come from an allocator holding its own lock: no hook runs here (a
        # publisher's snapshot would ask that allocator to flush); see `at_safe_point`.
        with ledger._lock:
            if event is PoolEvent.HANDLES_CREATED:
                self._require_vmm(event)
                self.handle_pages += count
                self.peak_handle_pages = max(self.peak_handle_pages, self.handle_pages)
            elif event is PoolEvent.HANDLES_RELEASED:
                self._require_vmm(event)
                self._check_nonnegative(self.handle_pages - count, "handle_pages", event)
                self.handle_pages -= count
            elif event is PoolEvent.PAGES_MAPPED:
                self._require_vmm(event)
                self.mapped_pages += count
                self.pages_mapped_total += count
                self.map_seconds_total += seconds
                self.map_calls += 1
                if count:
                    per_page = seconds / count
                    self.map_bucket_counts[bisect.bisect_left(MAP_SECONDS_BUCKETS, per_page)] += (
                        count
                    )
            elif event is PoolEvent.PAGES_UNMAPPED:
                self._require_vmm(event)
                self._check_nonnegative(self.mapped_pages - count, "mapped_pages", event)
                self.mapped_pages -= count
                self.pages_unmapped_total += count
                self.unmap_seconds_total += seconds
            elif event is PoolEvent.DRIVER_FAILURES:
                self.driver_failures_total += count
            else:  # pragma: no cover - exhaustive over PoolEvent
                raise LedgerError(f"unknown event {event!r}")
            ledger._epoch += 1

    def on_slots(self, occupied: int, peak: int) -> None:
        """The allocator's own slot count (see accounting.events): set, not added; both in
        units of `slots_per_count`."""
        occupied *= self.slots_per_count
        peak *= self.slots_per_count
        with self._ledger._lock:
            if not 0 <= occupied <= peak <= self.capacity_slots:
                raise LedgerError(
                    f"account {self.key!r}: slots reported occupied={occupied} peak={peak}, "
                    f"expected 0 <= occupied <= peak <= capacity_slots={self.capacity_slots}"
                )
            self._occupied_slots = occupied
            if peak > self.peak_occupied_slots:
                self.peak_occupied_slots = peak
            self._ledger._epoch += 1

    # -- holders and pressure (accounting.figures.Held) ----------------------------------
    def set_holders(self, tree_protected: int, tree_evictable: int) -> None:
        """The slots of this account the engine's prefix tree holds, locked by a request
        (`tree_protected`) or not (`tree_evictable`), as read now; every other occupied slot
        is then `request_only`. A reader that knows there is no tree passes (0, 0). Slots,
        not units of `slots_per_count`. If the tree claims more than is occupied, the
        snapshot says so (a violation of the holders' sum), nothing is clamped away."""
        for name, v in (("tree_protected", tree_protected), ("tree_evictable", tree_evictable)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise LedgerError(f"account {self.key!r}: {name}={v!r}, expected an int >= 0")
        held = (tree_protected, tree_evictable)
        with self._ledger._lock:
            if held != self._tree_held:
                self._tree_held = held
                self._ledger._epoch += 1

    def clear_holders(self) -> None:
        """Holders unknown from now on: every occupied slot is `unattributed`."""
        with self._ledger._lock:
            if self._tree_held is not None:
                self._tree_held = None
                self._ledger._epoch += 1

    def count_evicted(self, slots: int, *, window: bool = False) -> None:
        """`slots` freed by the engine's prefix-tree eviction, or (`window`) freed because
        they left a sliding window. Counters only: occupancy is reported apart."""
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
            raise LedgerError(f"account {self.key!r}: evicted slots={slots!r}, expected >= 0")
        if not slots:
            return
        with self._ledger._lock:
            if window:
                self.window_evicted_slots_total += slots
            else:
                self.evicted_slots_total += slots
            self._ledger._epoch += 1

    def _held(self) -> tuple[int, int, int, int]:
        occupied = self._occupied_slots
        if self._tree_held is None:
            return (0, 0, 0, occupied)
        protected, evictable = self._tree_held
        return (protected, evictable, max(occupied - protected - evictable, 0), 0)

    def attach(self, flush: Callable[[], None]) -> None:
        with self._ledger._lock:
            if self._flush is not None and self._flush != flush:
                raise LedgerError(
                    f"account {self.key!r}: an allocator is already attached, expected one "
                    "allocator per account"
                )
            self._flush = flush

    def detach(self, flush: Callable[[], None]) -> None:
        with self._ledger._lock:
            if self._flush == flush:
                self._flush = None

    def at_safe_point(self) -> None:
        if self._ledger._event_hook is not None:
            self._ledger._run_hook()

    # -- runtime-owned occupancy ---------------------------------------------
    def occupy(self, slots: int) -> None:
        """Whoever allocates rows of a runtime-owned buffer reports them here."""
        self.on_pool_event(PoolEvent.SLOTS_OCCUPIED, slots)

    def release(self, slots: int) -> None:
        self.on_pool_event(PoolEvent.SLOTS_FREED, slots)

    # -- internals ------------------------------------------------------------
    def _set_occupied(self, value: int, event: PoolEvent) -> None:
        self._check_nonnegative(value, "occupied_slots", event)
        if value > self.capacity_slots:
            raise LedgerError(
                f"account {self.key!r}: {event.value} makes occupied_slots={value}, "
                f"expected <= capacity_slots={self.capacity_slots}"
            )
        self._occupied_slots = value
        self.peak_occupied_slots = max(self.peak_occupied_slots, value)

    def _check_nonnegative(self, value: int, name: str, event: PoolEvent) -> None:
        if value < 0:
            raise LedgerError(
                f"account {self.key!r}: {event.value} makes {name}={value}, expected >= 0"
            )

    def _require_vmm(self, event: PoolEvent) -> None:
        if self.owner is not Owner.VMM:
            raise LedgerError(
                f"account {self.key!r}: {event.value} on a {self.owner.value}-owned account, "
                "expected a vmm-owned one"
            )

    def _row(self) -> AccountRow:
        protected, evictable, request_only, unattributed = self._held()
        return AccountRow(
            key=self.key,
            family=self.family,
            pool=self.pool,
            owner=self.owner,
            page_bytes=self.page_bytes,
            capacity_slots=self.capacity_slots,
            occupied_slots=self._occupied_slots,
            peak_occupied_slots=self.peak_occupied_slots,
            handle_pages=self.handle_pages,
            peak_handle_pages=self.peak_handle_pages,
            mapped_pages=self.mapped_pages,
            pages_mapped_total=self.pages_mapped_total,
            pages_unmapped_total=self.pages_unmapped_total,
            map_seconds_total=self.map_seconds_total,
            unmap_seconds_total=self.unmap_seconds_total,
            map_calls=self.map_calls,
            map_bucket_counts=tuple(self.map_bucket_counts),
            driver_failures_total=self.driver_failures_total,
            slot_bytes=sum(b.slot_bytes for b in self.buffers),
            held_tree_protected=protected,
            held_tree_evictable=evictable,
            held_request_only=request_only,
            held_unattributed=unattributed,
            evicted_slots_total=self.evicted_slots_total,
            window_evicted_slots_total=self.window_evicted_slots_total,
        )


def buffer_rows(account: AccountRow, specs: tuple[BufferSpec, ...]) -> list[BufferRow]:
    """The per-buffer figures of one account, derived from its counters and the buffers' sizes."""
    vmm = account.owner is Owner.VMM
    rows = []
    for spec in specs:
        if vmm:
            physical = account.handle_pages * account.page_bytes
            mapped = account.mapped_pages * account.page_bytes
        else:
            physical = mapped = spec.reserved_bytes
        rows.append(
            BufferRow(
                spec=spec,
                account=account.key,
                physical_bytes=physical,
                mapped_bytes=mapped,
                occupied_slots=account.occupied_slots,
                page_bytes=account.page_bytes,
            )
        )
    return rows


TruthReader = Callable[[Snapshot], Mapping[str, Any]]


class Ledger:
    """All accounts of one process (one rank), labelled with the engine's labels."""

    def __init__(self, labels: Mapping[str, str] | None = None) -> None:
        self.labels: dict[str, str] = dict(labels or {})
        self._lock = threading.RLock()
        self._accounts: dict[str, Account] = {}
        self._buffer_names: set[tuple[str, str]] = set()
        self._epoch = 0
        self._truth: list[TruthReader] = []
        # Called (outside the lock) every `_hook_every` events by whichever thread reported
        # them: how a publisher does its work on the allocating thread at a bounded rate.
        self._event_hook: Callable[[], None] | None = None
        self._hook_every = 64
        self._hook_countdown = 64
        self._tp_status: Callable[[], TpStatus] | None = None
        self._probes: list[Callable[[], None]] = []
        self._engine_state: Callable[[], EngineState | None] | None = None
        self._request_slots: Callable[[], RequestSlots | None] | None = None

    def add_probe(self, probe: Callable[[], None]) -> None:
        """Call `probe` at the start of every snapshot, before the allocators report: how a
        reader of an engine's own state (its prefix tree's holders) sets the accounts as of
        that snapshot. It must be cheap (O(1)) and must not raise."""
        with self._lock:
            self._probes.append(probe)

    def remove_probe(self, probe: Callable[[], None]) -> None:
        with self._lock:
            if probe in self._probes:
                self._probes.remove(probe)

    @property
    def epoch(self) -> int:
        """Changes applied so far: the epoch a snapshot taken now would carry (attached
        allocators report their slots first, as for a snapshot)."""
        self._flush_allocators()
        return self._epoch

    def _flush_allocators(self) -> None:
        for flush in [a._flush for a in self.accounts() if a._flush is not None]:
            flush()

    def add_account(
        self,
        buffers: Iterable[BufferSpec],
        *,
        key: str | None = None,
        page_bytes: int = 0,
        capacity_slots: int | None = None,
        slots_per_count: int = 1,
    ) -> Account:
        """Register the buffers of one index space. All must share family, pool and owner.

        VMM accounts need `page_bytes` (the size of one physical page of one buffer).
        Runtime accounts hold their storage as physical bytes from the start.
        `slots_per_count`: the slots one unit of the reported slot counts stands for
        (`Account`).
        """
        specs = tuple(buffers)
        if not specs:
            raise ValueError("add_account: buffers is empty, expected at least one BufferSpec")
        first = specs[0]
        for s in specs[1:]:
            if (s.family, s.pool, s.owner) != (first.family, first.pool, first.owner):
                raise ValueError(
                    f"add_account: buffer {s.name!r} is ({s.family}, {s.pool}, {s.owner.value}), "
                    f"expected ({first.family}, {first.pool}, {first.owner.value}) like {first.name!r}"
                )
        if first.owner is Owner.VMM and page_bytes <= 0:
            raise ValueError(
                f"add_account: page_bytes={page_bytes} for a vmm account, expected > 0"
            )
        capacity = first.capacity_slots if capacity_slots is None else capacity_slots
        key = key or f"{first.pool}/{first.family}"
        with self._lock:
            if key in self._accounts:
                raise ValueError(f"add_account: key {key!r} is already registered")
            for s in specs:
                if (s.pool, s.name) in self._buffer_names:
                    raise ValueError(
                        f"add_account: buffer {s.name!r} of pool {s.pool!r} is already registered"
                    )
            account = Account(
                self,
                key=key,
                family=first.family,
                pool=first.pool,
                owner=first.owner,
                buffers=specs,
                page_bytes=page_bytes,
                capacity_slots=capacity,
                slots_per_count=slots_per_count,
            )
            self._accounts[key] = account
            self._buffer_names.update((s.pool, s.name) for s in specs)
            self._epoch += 1
        return account

    def remove_account(self, account: Account) -> None:
        """Drop an account whose memory is gone. Refuses one that still holds memory or slots."""
        with self._lock:
            if self._accounts.get(account.key) is not account:
                raise ValueError(f"remove_account: {account.key!r} is not registered here")
            if account._flush is not None:
                raise LedgerError(
                    f"remove_account: {account.key!r} is still attached to an open allocator"
                )
            if account.handle_pages or account.mapped_pages or account._occupied_slots:
                raise LedgerError(
                    f"remove_account: {account.key!r} still holds handle_pages={account.handle_pages} "
                    f"mapped_pages={account.mapped_pages} occupied_slots={account._occupied_slots}"
                )
            del self._accounts[account.key]
            self._buffer_names.difference_update((s.pool, s.name) for s in account.buffers)
            self._epoch += 1

    def accounts(self) -> tuple[Account, ...]:
        with self._lock:
            return tuple(self._accounts.values())

    def set_event_hook(self, hook: Callable[[], None] | None, *, every: int = 64) -> None:
        """Call `hook` on the reporting thread, outside the ledger's lock, after every
        `every`-th slot change reported one by one and at every safe point of an attached
        allocator (which comes every few of its calls). None removes it. It must be cheap
        when it has nothing to do."""
        if not isinstance(every, int) or every <= 0:
            raise ValueError(f"set_event_hook: every={every!r}, expected a positive int")
        with self._lock:
            self._event_hook = hook
            self._hook_every = self._hook_countdown = every

    @property
    def event_hook(self) -> Callable[[], None] | None:
        """The hook `set_event_hook` installed, or None."""
        return self._event_hook

    def clear_event_hook(self, hook: Callable[[], None]) -> bool:
        """Remove the event hook if it is still `hook` (compared with ==, so a bound method
        matches itself); True when it was. A hook someone installed since stays."""
        with self._lock:
            if self._event_hook is None or self._event_hook != hook:
                return False
            self._event_hook = None
            return True

    def _after_event(self) -> None:
        # A plain decrement under the GIL; a lost update only shifts when the hook runs.
        self._hook_countdown -= 1
        if self._hook_countdown <= 0:
            self._hook_countdown = self._hook_every
            hook = self._event_hook
            if hook is not None:
                hook()

    def _run_hook(self) -> None:
        hook = self._event_hook
        if hook is not None:
            hook()

    def add_truth(self, reader: TruthReader) -> None:
        """Add a reconciliation source, read once per snapshot (see accounting.reconcile)."""
        self._truth.append(reader)

    def remove_truth(self, reader: TruthReader) -> bool:
        """Stop reading `reader` (added by `add_truth`); False when it is not here."""
        for i, r in enumerate(self._truth):
            if r is reader:
                del self._truth[i]
                return True
        return False

    def set_tp_status(self, source: Callable[[], TpStatus] | None) -> None:
        """Carry a TP rank's control-traffic status in each snapshot (allocator.tp sets it)."""
        with self._lock:
            self._tp_status = source
            self._epoch += 1

    def set_engine_state(self, source: Callable[[], EngineState | None] | None) -> None:
        """Carry what an engine's holder reader says (accounting.engine_state) in each
        snapshot: `source` is called once per snapshot, after the probes."""
        with self._lock:
            self._engine_state = source
            self._epoch += 1

    def set_request_slots(self, source: Callable[[], RequestSlots | None] | None) -> None:
        """Carry running requests' slots per family (accounting.request_slots) in each
        snapshot: `source` is called once per snapshot, under the ledger's lock, and must
        only return what its engine last read (O(1))."""
        with self._lock:
            self._request_slots = source
            self._epoch += 1

    def snapshot(self, *, reconcile: bool = True) -> Snapshot:
        # Under the lock only the account counters are copied (a handful of small rows), so
        # an allocator event waits at most that long; rows, rollups and relation checks are
        # built from the copy. Truth is read after, unless its reader can hold the pool
        # quiescent (below): a backend call in flight can put the device ahead of the ledger
        # by whole pages whether or not the ledger's lock is held.
        # Attached allocators report their slots first (each under its own lock, taken
        # before the ledger's as on the allocation path), so the copy is as of now.
        # The TP status is read first under the lock, the rows and the epoch after it: all
        # as of the moment the lock was taken (an event reported meanwhile waits).
        for probe in tuple(self._probes):
            probe()
        # A truth reader with `quiesce` and `measure` (accounting.reconcile.HostMemfdTruth):
        # its quiesce (no driver call in flight) is held across the flush, the copy and its
        # device read, so the ledger's figures and the device's are of one instant; the
        # snapshot is built and compared after, off it.
        readers = list(self._truth) if reconcile else []
        measured: list[Any] = [None] * len(readers)
        with contextlib.ExitStack() as quiet:
            for r in readers:
                q = getattr(r, "quiesce", None)
                if q is not None and hasattr(r, "measure"):
                    quiet.enter_context(q())
            self._flush_allocators()
            with self._lock:
                tp = self._tp_status() if self._tp_status is not None else None
                engine = self._engine_state() if self._engine_state is not None else None
                slots = self._request_slots() if self._request_slots is not None else None
                copied = [(a._row(), a.buffers) for a in self._accounts.values()]
                epoch = self._epoch
                labels = dict(self.labels)
            for i, r in enumerate(readers):
                if getattr(r, "quiesce", None) is not None and hasattr(r, "measure"):
                    measured[i] = (r.measure(),)
        snap = Snapshot.build(
            epoch=epoch,
            taken_at=time.time(),
            labels=labels,
            accounts=[row for row, _ in copied],
            buffers=[b for row, specs in copied for b in buffer_rows(row, specs)],
            tp=tp,
            engine=engine,
            request_slots=slots,
        )
        if readers:
            snap = snap.with_reconciliation(
                [
                    dict(r(snap) if m is None else r.reconcile(snap, m[0]))  # type: ignore[attr-defined]
                    for r, m in zip(readers, measured, strict=True)
                ]
            )
        return snap
