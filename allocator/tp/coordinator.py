"""Tensor parallelism: one SwaPool per TP rank; rank 0 decides the pages, the peers follow.

What is deterministic, what is not
    SGLang's schedulers on all TP ranks run the same allocation sequence: the same
    `alloc(n)` and `free(ids)` calls in the same order, from one thread. A pool's choice
    of slot ids is a function of that sequence and of its page state (which pages are
    mapped, in which order they became spare). Same code on every rank (int sets and
    insertion-ordered dicts evolve identically), so given the same page operations at the
    same points of the sequence every rank hands out the same ids in the same order. A
    `BackgroundMapper` is timing-dependent: it maps and unmaps when its thread gets to it,
    so which spare pages exist when an alloc runs would depend on thread timing on rank 0,
    and no peer could reproduce rank 0's ids without an exchange on every alloc. A pool
    under TP therefore takes no BackgroundMapper (attaching one is refused both ways):
    every change of the *allocatable* page state happens inside an alloc or a free.

When ranks talk
    A page changes at exactly two points, and every rank sees from its own state that it
    has reached one:
    - an alloc that the free slots of allocatable pages cannot meet: pages must be added;
    - a free that leaves more than `max_spare_pages` spare pages: some must be unmapped.
    There every rank joins one exchange: an all_gather, over a CPU gloo group, of one
    fixed-size int64 view per rank (`VIEW_WORDS` words). Rank 0's view carries its
    decision: the page ids its own policy chose, or its refusal (CapacityError; then every
    rank raises it and nothing changes). A peer applies those pages instead of planning
    (its policy is off), mapping or unmapping each in every layer on its own backend, then
    finishes the operation with the same code rank 0 runs. An operation that changes no
    page exchanges nothing; one that does costs one collective, never one per layer.
    Lists longer than `PLAN_WORDS` pages take extra rounds of the same size. The first
    exchange, at attach, compares the pools' configurations.

Mapping ahead (`ahead_pages=k`, off by default)
    Timing may decide when a page is *mapped*, as long as it never decides when a page
    becomes *allocatable*. Rank 0 announces up to k unmapped pages as reserved at an
    exchange (at attach, then at each page-adding one); every rank marks them at the end
    of that operation (out of the unmapped pages, a handle set counted, not allocatable),
    and each rank's own thread maps them off the allocation path. At the next page-adding
    exchange rank 0's plan takes reserved pages first: every rank publishes them (makes
    them allocatable), mapping on the spot any its thread has not finished, so the
    exchange is all that sits on the allocation path. Unmapping stays on the free path.

Divergence
    Each view also carries the rank's position (operations done, exchanges done), the
    current operation (kind, size, slots short or pages over), its pool state (occupied
    slots, mapped, spare and reserved pages, live handle sets) and a digest of every
    result so far (the ids each alloc handed out and each free returned). Every rank
    compares every view with rank 0's; on any difference every rank counts it
    (`TpStatus.divergences_total`, in each ledger snapshot), raises `TpDivergenceError`
    naming each differing rank's view next to rank 0's, and refuses every later
    operation. A peer also checks that rank 0's page lists fit its own pool before
    applying them. A divergence is caught at the first exchange after it; operations
    between the two are not checked: `verify()` forces an exchange (call it once per
    scheduler step for a strict mode, at one collective per step).

A rank that dies or hangs
    Each exchange waits at most `timeout_s`; a dead peer's closed connection fails at
    once. Either raises `TpPeerError` on the ranks still alive, counted in
    `TpStatus.peer_failures_total`, and the coordinator refuses every later operation.

Modules
    This one: the protocol above and `TpCoordinator`, a rank's side of it (attach and the
    configuration handshake, the pool's hooks, rank 0's plans and a peer's following,
    mapping ahead, close). allocator.tp.exchange: the wire side (the view's layout and
    digests, the all_gather, the comparison of views and the check of rank 0's lists, the
    errors). allocator.tp.pages: the page store's side (`TpPages`, given the store).
"""

from __future__ import annotations

import datetime
import logging
import threading
from typing import Any

from accounting.tp_status import TpStatus
from allocator.checks import check_count
from allocator.errors import CapacityError
from allocator.slots.pool import SwaPool
from allocator.tp.exchange import (
    HELLO,
    MAP,
    UNMAP,
    VERIFY,
    TpError,
    TpExchange,
    config_digest,
)
from allocator.tp.pages import TpPages

__all__ = ["TpCoordinator"]

log = logging.getLogger(__name__)


class TpCoordinator:
    """Attach one rank's SwaPool to its TP group. Use as a context manager or call close().

    `group`: a gloo process group over the TP ranks (SGLang keeps one for TP); if None, one
    is created over the default group with `torch.distributed.new_group` (a collective:
    every rank must construct its coordinator). `timeout_s` bounds every exchange.
    `ledger`: this rank's Ledger; it gets the `tp_rank` label and this coordinator's
    `TpStatus` in every snapshot.
    """

    def __init__(
        self,
        pool: SwaPool,
        *,
        group: Any = None,
        timeout_s: float = 60.0,
        ledger: Any = None,
        ahead_pages: int = 0,
    ) -> None:
        import torch.distributed as dist

        check_count("ahead_pages", ahead_pages, 0)

        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s={timeout_s!r}, expected a positive number of seconds")
        if pool.closed:
            raise ValueError(f"pool {pool.name!r} is closed, expected an open pool")
        store = pool.store
        self.pool = pool
        self.pages = TpPages(store)
        self.timeout_s = float(timeout_s)
        self.ahead_pages = ahead_pages
        self._closed = False
        self._pending_reserve: list[int] = []
        self._ahead_errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        with store.lock:
            store.attach_tp(self)  # refused with a background mapper or another coordinator
        try:
            self._connect(dist, group, ledger, ahead_pages)
        except BaseException:
            with store.lock:
                store.detach_tp(self)
            raise
        if ahead_pages:
            self._thread = threading.Thread(
                target=self._ahead_loop, name=f"kvledger-tp-ahead-{pool.name}", daemon=True
            )
            self._thread.start()

    def _connect(self, dist: Any, group: Any, ledger: Any, ahead_pages: int) -> None:
        """The group, the wire, the ledger's label and the handshake (HELLO: the pages first
        reserved ahead); on a failure the wire is released."""
        pool = self.pool
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: call init_process_group first "
                "(or pass group=)"
            )
        own_group = group is None
        if group is None:
            group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s)
            )
        backend = str(dist.get_backend(group))
        if backend != "gloo":
            raise ValueError(f"group backend={backend!r}, expected 'gloo' (CPU control tensors)")
        self._wire = TpExchange(
            pool,
            self.pages,
            dist,
            group,
            own_group=own_group,
            timeout_s=self.timeout_s,
            config=config_digest(pool, ahead_pages),
        )
        self.rank = self._wire.rank
        self.size = self._wire.size
        if ledger is not None:
            have = ledger.labels.get("tp_rank")
            if have is not None and have != str(self.rank):
                self._wire.release()
                raise ValueError(
                    f"ledger label tp_rank={have!r}, expected {str(self.rank)!r} (this rank)"
                )
            ledger.labels["tp_rank"] = str(self.rank)
            ledger.set_tp_status(self.status)
        with pool.store.lock:
            try:
                mine = self._choose_reserve(0, []) if self.rank == 0 else []
                _, _, reserve, _ = self._wire.exchange(HELLO, 0, reserve=mine)
                self._wire.check_pages(reserve, "unmapped", "reserve", HELLO, 0)
                self.pages.reserve_locked(reserve)
            except BaseException:
                self._wire.release()
                raise

    # -- called by the pool and its store, under the store's lock -------------------------
    def op_started(self, op: str, n: int) -> None:
        self._wire.op_started(op, n)

    def op_done(self, ids: list[int]) -> None:
        self._wire.op_done(ids)
        if self._pending_reserve:  # announced at this op's exchange: marked at its end
            pages, self._pending_reserve = self._pending_reserve, []
            self.pages.reserve_locked(pages)

    def plan_map(self, need: int) -> list[int]:
        """Page ids to map so that `need` more slots can be handed out; reserved pages the
        plan takes are published here first (mapped ahead, or now)."""
        pool = self.pool
        if self.rank == 0:
            reserved = sorted(self.pages.reserved)
            try:
                while True:
                    plan = pool.gather.plan_pages(
                        need, reserved + pool.store.unmapped if reserved else None
                    )
                    if plan is not None:
                        break
                    pool.store.cond.wait(timeout=1.0)  # an ahead map in flight; capacity is short
            except CapacityError as e:
                self._wire.exchange(MAP, need, refused=True)
                raise CapacityError(f"{e} (TP rank 0 decides; every rank refuses)") from None
            held = set(reserved)
            publish = [p for p in plan if p in held]
            plan = [p for p in plan if p not in held]
            reserve = self._choose_reserve(len(reserved) - len(publish), plan)
            self._wire.exchange(MAP, need, publish, plan, reserve)
        else:
            publish, plan, reserve, refused = self._wire.exchange(MAP, need)
            if refused:
                raise CapacityError(
                    f"{pool.name}: TP rank 0 could not allocate {need} more slots "
                    f"(CapacityError there); rank {self.rank} follows it, nothing changed"
                )
            self._wire.check_pages(publish, "reserved", "publish", MAP, need)
            self._wire.check_pages(plan, "unmapped", "map", MAP, need)
            self._wire.check_pages(reserve, "unmapped", "reserve", MAP, need, exclude=plan)
        self.pages.publish_locked(publish)
        self._pending_reserve = reserve
        return plan

    def plan_unmap(self, excess: int) -> list[int]:
        """Spare page ids to unmap, `excess` of them."""
        if self.rank == 0:
            plan = self.pages.trim_plan(excess)
            self._wire.exchange(UNMAP, excess, plan=plan)
            return plan
        _, plan, _, _ = self._wire.exchange(UNMAP, excess)
        self._wire.check_pages(plan, "spare", "unmap", UNMAP, excess)
        return plan

    def trim_locked(self) -> None:
        """Unmap the spares over `max_spare_pages`, as rank 0 names them (the store's spare
        policy calls it after a free instead of its own timed trim)."""
        store = self.pool.store
        for p in self.plan_unmap(len(store.spares) - store.policy.max_spare_pages):
            store.unmap_spare_locked(p)

    # -- public ---------------------------------------------------------------------------
    def verify(self) -> None:
        """Exchange now and compare every rank's view with rank 0's (one collective)."""
        with self.pool.store.lock:
            self._wire.refuse_if_failed()
            if self._closed or self.pool.store.tp is not self:
                raise TpError("verify: this coordinator is closed or no longer attached")
            self._wire.exchange(VERIFY, 0)

    def status(self) -> TpStatus:
        return self._wire.status()

    @property
    def failed(self) -> TpError | None:
        return self._wire.failed

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until every page reserved ahead is mapped (tests, benchmarks)."""
        pool = self.pool
        with pool.store.cond:
            return pool.store.cond.wait_for(lambda: pool.closed or self.pages.idle(), timeout)

    def close(self) -> None:
        """Stop mapping ahead, give the reserved pages back, detach from the pool (it works
        alone again) and drop an own group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        with self.pool.store.cond:
            self.pool.store.cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        try:
            with self.pool.store.lock:
                if self.pool.store.detach_tp(self):
                    self.pages.drop_locked()
        finally:
            self._wire.release()

    # -- mapping ahead ---------------------------------------------------------------------
    def _choose_reserve(self, kept: int, plan: list[int]) -> list[int]:
        """Rank 0: unmapped pages to announce for mapping ahead, lowest first, so that
        `ahead_pages` are reserved after `plan` is mapped, within the physical budget."""
        pool = self.pool
        want = self.ahead_pages - kept
        if want <= 0:
            return []
        spare = pool.store.kept_sets
        live = pool.store.live_sets + max(0, len(plan) - spare)
        spare = max(0, spare - len(plan))
        budget = pool.physical_budget
        skip = set(plan)
        out: list[int] = []
        for p in pool.store.unmapped:
            if len(out) == want:
                break
            if p in skip:
                continue
            if spare:
                spare -= 1
            elif budget is None or (live + 1) * pool.set_bytes <= budget:
                live += 1
            else:
                break
            out.append(p)
        return out

    def _ahead_loop(self) -> None:
        pool = self.pool
        while not self._stop.is_set():
            with pool.store.cond:
                job = None if pool.closed else self.pages.next_job_locked()
                if job is None:
                    pool.store.cond.wait(timeout=0.05)
                    continue
            try:
                self.pages.map_ahead(job)
            except Exception:
                self._ahead_errors += 1
                log.exception("TP pool %r: mapping page %d ahead failed", pool.name, job.page)
                self._stop.wait(1.0)  # the exchange that publishes it maps it, or raises

    def __enter__(self) -> TpCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
