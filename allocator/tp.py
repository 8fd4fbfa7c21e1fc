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
"""

from __future__ import annotations

import array
import contextlib
import datetime
import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from accounting.tp_status import TpStatus
from allocator.errors import CapacityError, KvAllocatorError
from allocator.pool import SwaPool

log = logging.getLogger(__name__)

PLAN_WORDS = 48  # page ids carried in one view; more take extra rounds
MAGIC = 0x6B764C_0001  # protocol tag and version: a rank running other code mismatches here

# View layout: one int64 word per field, then the plan.
_FIELDS = (
    "magic",
    "rank",
    "exchange",
    "op_seq",
    "kind",
    "op_n",
    "short",
    "occupied_slots",
    "mapped_pages",
    "spare_pages",
    "live_handle_sets",
    "reserved_pages",
    "trace",
    "config",
    "refused",
    "publish_len",
    "plan_len",
    "reserve_len",
)
_IDX = {name: i for i, name in enumerate(_FIELDS)}
_LISTS = ("publish_len", "plan_len", "reserve_len")  # rank 0's page lists, in this order
_COMPARED = tuple(f for f in _FIELDS if f not in ("rank", "refused", *_LISTS))
VIEW_WORDS = len(_FIELDS) + PLAN_WORDS

HELLO, MAP, UNMAP, VERIFY = 1, 2, 3, 4
_KIND_NAMES = {HELLO: "hello", MAP: "map", UNMAP: "unmap", VERIFY: "verify"}
_OP_CODES = {"none": 0, "alloc": 1, "free": 2}
_OP_NAMES = {v: k for k, v in _OP_CODES.items()}
_MASK = (1 << 64) - 1


class TpError(KvAllocatorError):
    """The TP group can no longer be trusted; every later operation raises it again."""


class TpDivergenceError(TpError):
    """A rank's allocation sequence or pool state no longer matches rank 0's."""


class TpPeerError(TpError):
    """An exchange failed: a rank died, or did not answer within the timeout."""


def _digest(prev: int, values: Sequence[int]) -> int:
    """64-bit digest of `prev` and `values`: the same on every rank, build and Python."""
    h = hashlib.blake2b(prev.to_bytes(8, "little"), digest_size=8)
    h.update(array.array("q", values))
    return int.from_bytes(h.digest(), "little")


def _signed64(x: int) -> int:
    x &= _MASK
    return x - (1 << 64) if x >> 63 else x


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

        if not isinstance(ahead_pages, int) or isinstance(ahead_pages, bool) or ahead_pages < 0:
            raise ValueError(f"ahead_pages={ahead_pages!r}, expected an int >= 0")

        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s={timeout_s!r}, expected a positive number of seconds")
        if pool.closed:
            raise ValueError(f"pool {pool.name!r} is closed, expected an open pool")
        if pool.store.mapper is not None:
            raise ValueError(
                f"pool {pool.name!r} has a background mapper, expected none: under TP its "
                "timing would decide rank 0's slot ids (see allocator.tp)"
            )
        if pool.store.tp is not None:
            raise ValueError(f"pool {pool.name!r} already follows a TP group")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: call init_process_group first "
                "(or pass group=)"
            )
        self._dist = dist
        self.pool = pool
        self.timeout_s = float(timeout_s)
        self._own_group = group is None
        if group is None:
            group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s)
            )
        backend = str(dist.get_backend(group))
        if backend != "gloo":
            raise ValueError(f"group backend={backend!r}, expected 'gloo' (CPU control tensors)")
        self._group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._ops_done = 0
        self._op = (0, 0)  # (op code, size) of the operation in progress
        self._trace = 0
        self._exchanges = 0
        self._page_ops = 0
        self._divergences = 0
        self._peer_failures = 0
        self._failed: TpError | None = None
        self._last_error = ""
        self._closed = False
        self.ahead_pages = ahead_pages
        self._pending_reserve: list[int] = []
        self._ahead_errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._config = _digest(0, (*pool.tp_config(), ahead_pages))
        if ledger is not None:
            have = ledger.labels.get("tp_rank")
            if have is not None and have != str(self.rank):
                self._release_group()
                raise ValueError(
                    f"ledger label tp_rank={have!r}, expected {str(self.rank)!r} (this rank)"
                )
            ledger.labels["tp_rank"] = str(self.rank)
            ledger.set_tp_status(self.status)
        with pool.store.lock:
            pool.store.tp = self
            try:
                mine = self._choose_reserve(0, []) if self.rank == 0 else []
                _, _, reserve, _ = self._exchange(HELLO, 0, reserve=mine)
                self._check_pages(reserve, "unmapped", "reserve", HELLO, 0)
                pool.store.tp_reserve_locked(reserve)
            except BaseException:
                pool.store.tp = None
                self._release_group()
                raise
        if ahead_pages:
            self._thread = threading.Thread(
                target=self._ahead_loop, name=f"kvledger-tp-ahead-{pool.name}", daemon=True
            )
            self._thread.start()

    # -- called by the pool, under its lock -----------------------------------------------
    def op_started(self, op: str, n: int) -> None:
        if self._failed is not None:
            raise type(self._failed)(f"refused: this TP group failed earlier: {self._failed}")
        self._op = (_OP_CODES[op], n)

    def op_done(self, ids: list[int]) -> None:
        code, n = self._op
        self._trace = _digest(_digest(self._trace, (code, n)), ids)
        self._ops_done += 1
        self._op = (0, 0)
        if self._pending_reserve:  # announced at this op's exchange: marked at its end
            pages, self._pending_reserve = self._pending_reserve, []
            self.pool.store.tp_reserve_locked(pages)

    def plan_map(self, need: int) -> list[int]:
        """Page ids to map so that `need` more slots can be handed out; reserved pages the
        plan takes are published here first (mapped ahead, or now)."""
        pool = self.pool
        if self.rank == 0:
            reserved = sorted(pool.store.tp_reserve)
            try:
                while True:
                    plan = pool.plan_pages(
                        need, reserved + pool.store.unmapped if reserved else None
                    )
                    if plan is not None:
                        break
                    pool.store.cond.wait(timeout=1.0)  # an ahead map in flight; capacity is short
            except CapacityError as e:
                self._exchange(MAP, need, refused=True)
                raise CapacityError(f"{e} (TP rank 0 decides; every rank refuses)") from None
            held = set(reserved)
            publish = [p for p in plan if p in held]
            plan = [p for p in plan if p not in held]
            reserve = self._choose_reserve(len(reserved) - len(publish), plan)
            self._exchange(MAP, need, publish, plan, reserve)
        else:
            publish, plan, reserve, refused = self._exchange(MAP, need)
            if refused:
                raise CapacityError(
                    f"{pool.name}: TP rank 0 could not allocate {need} more slots "
                    f"(CapacityError there); rank {self.rank} follows it, nothing changed"
                )
            self._check_pages(publish, "reserved", "publish", MAP, need)
            self._check_pages(plan, "unmapped", "map", MAP, need)
            self._check_pages(reserve, "unmapped", "reserve", MAP, need, exclude=plan)
        pool.store.tp_publish_locked(publish)
        self._pending_reserve = reserve
        return plan

    def plan_unmap(self, excess: int) -> list[int]:
        """Spare page ids to unmap, `excess` of them."""
        if self.rank == 0:
            plan = self.pool.store.tp_trim_plan(excess)
            self._exchange(UNMAP, excess, plan=plan)
            return plan
        _, plan, _, _ = self._exchange(UNMAP, excess)
        self._check_pages(plan, "spare", "unmap", UNMAP, excess)
        return plan

    # -- public ---------------------------------------------------------------------------
    def verify(self) -> None:
        """Exchange now and compare every rank's view with rank 0's (one collective)."""
        with self.pool.store.lock:
            if self._failed is not None:
                raise type(self._failed)(f"refused: this TP group failed earlier: {self._failed}")
            self._check_attached("verify")
            self._exchange(VERIFY, 0)

    def status(self) -> TpStatus:
        return TpStatus(
            rank=self.rank,
            size=self.size,
            exchanges_total=self._exchanges,
            page_ops_total=self._page_ops,
            divergences_total=self._divergences,
            peer_failures_total=self._peer_failures,
            last_error=self._last_error,
        )

    @property
    def failed(self) -> TpError | None:
        return self._failed

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until every page reserved ahead is mapped (tests, benchmarks)."""
        pool = self.pool
        with pool.store.cond:
            return pool.store.cond.wait_for(
                lambda: pool.closed or pool.store.tp_ahead_idle(), timeout
            )

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
                if self.pool.store.tp is self:
                    self.pool.store.tp = None
                    self.pool.store.tp_drop_reserve_locked()
        finally:
            self._release_group()

    # -- mapping ahead ---------------------------------------------------------------------
    def _choose_reserve(self, kept: int, plan: list[int]) -> list[int]:
        """Rank 0: unmapped pages to announce for mapping ahead, lowest first, so that
        `ahead_pages` are reserved after `plan` is mapped, within the physical budget."""
        pool = self.pool
        want = self.ahead_pages - kept
        if want <= 0:
            return []
        spare = len(pool.store.kept)
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
                job = None if pool.closed else pool.store.tp_ahead_job()
                if job is None:
                    pool.store.cond.wait(timeout=0.05)
                    continue
            try:
                pool.store.tp_ahead_map(*job)
            except Exception:
                self._ahead_errors += 1
                log.exception("TP pool %r: mapping page %d ahead failed", pool.name, job[0])
                self._stop.wait(1.0)  # the exchange that publishes it maps it, or raises

    def __enter__(self) -> TpCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the exchange ----------------------------------------------------------------------
    def _check_attached(self, what: str) -> None:
        if self._closed or self.pool.store.tp is not self:
            raise TpError(f"{what}: this coordinator is closed or no longer attached")

    def _release_group(self) -> None:
        if self._own_group and self._group is not None:
            group, self._group = self._group, None
            # A group whose collective timed out may refuse a clean teardown; the process
            # is failing anyway, so the error would only hide the one worth reading.
            with contextlib.suppress(Exception):
                self._dist.destroy_process_group(group)

    def _view(self, kind: int, short: int, lists: list[list[int]], refused: bool) -> list[int]:
        st = self.pool.store.tp_state()
        code, n = self._op
        op_seq = self._ops_done + (1 if code else 0)
        view = [
            MAGIC,
            self.rank,
            self._exchanges,
            op_seq,
            kind,
            code * (1 << 32) + n,
            short,
            st["occupied_slots"],
            st["mapped_pages"],
            st["spare_pages"],
            st["live_handle_sets"],
            st["reserved_pages"],
            _signed64(self._trace),
            _signed64(self._config),
            int(refused),
            *(len(x) for x in lists),
        ]
        words = [p for x in lists for p in x]
        return view + words[:PLAN_WORDS] + [0] * (PLAN_WORDS - min(len(words), PLAN_WORDS))

    def _exchange(
        self,
        kind: int,
        short: int,
        publish: list[int] | None = None,
        plan: list[int] | None = None,
        reserve: list[int] | None = None,
        *,
        refused: bool = False,
    ) -> tuple[list[int], list[int], list[int], bool]:
        """One all_gather of every rank's view; returns rank 0's page lists (publish, map,
        reserve) and its refusal. Only rank 0's lists are read."""
        lists = [list(publish or []), list(plan or []), list(reserve or [])]
        self._exchanges += 1
        views = self._all_gather(self._view(kind, short, lists, refused), kind)
        self._compare(views)  # every rank sees the same views, so all raise here or none
        leader = views[0]
        lens = [leader[_IDX[f]] for f in _LISTS]
        total = sum(lens)
        start = len(_FIELDS)
        got = leader[start : start + min(total, PLAN_WORDS)]
        mine = [p for x in lists for p in x]
        while len(got) < total:  # long lists: more rounds of the same size
            rest = mine[len(got) : len(got) + PLAN_WORDS] if self.rank == 0 else []
            more = self._all_gather(rest + [0] * (VIEW_WORDS - len(rest)), kind)[0]
            got += more[: min(PLAN_WORDS, total - len(got))]
        self._page_ops += lens[0] + lens[1]
        a, b = lens[0], lens[0] + lens[1]
        return got[:a], got[a:b], got[b:], bool(leader[_IDX["refused"]])

    def _all_gather(self, words: list[int], kind: int) -> list[list[int]]:
        import torch

        t = torch.tensor(words, dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.size)]
        t0 = time.monotonic()
        try:
            work = self._dist.all_gather(out, t, group=self._group, async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:
            self._peer_failures += 1
            self._fail(
                TpPeerError(
                    f"{self.pool.name}: TP rank {self.rank} of {self.size}: exchange "
                    f"#{self._exchanges} ({self._describe_own(kind)}) failed after "
                    f"{time.monotonic() - t0:.1f} s: a rank died or did not answer within "
                    f"timeout_s={self.timeout_s:g}: {e}"
                )
            )
        return [o.tolist() for o in out]

    def _compare(self, views: list[list[int]]) -> None:
        leader = views[0]
        bad = [
            (r, [f for f in _COMPARED if v[_IDX[f]] != leader[_IDX[f]]])
            for r, v in enumerate(views)
            if r and (v[_IDX["rank"]] != r or any(v[_IDX[f]] != leader[_IDX[f]] for f in _COMPARED))
        ]
        if not bad:
            return
        self._divergences += 1
        lines = [
            f"{self.pool.name}: TP ranks diverged at exchange #{leader[_IDX['exchange']]} "
            f"(seen by rank {self.rank}; a rank's allocation sequence or pool state no longer "
            "matches rank 0's, so its slot ids cannot be trusted):",
            f"  rank 0: {_describe(leader)}",
        ]
        for r, fields in bad:
            lines.append(f"  rank {r}: {_describe(views[r])}")
            lines.append(f"  rank {r} differs from rank 0 in: {', '.join(fields) or 'rank'}")
            if "config" in fields:
                lines.append(
                    f"  rank {r}'s pool is configured differently (layers, page bytes, slot "
                    "layout, max_spare_pages, handle_pool_pages, physical_budget or null slot); "
                    f"rank {self.rank}'s: {self.pool.tp_config()}"
                )
        self._fail(TpDivergenceError("\n".join(lines)))

    def _check_pages(
        self,
        pages: list[int],
        want: str,
        what: str,
        kind: int,
        short: int,
        exclude: list[int] | None = None,
    ) -> None:
        """A peer's check that rank 0's list fits its own pool before applying it."""
        pool = self.pool
        bad = [
            (
                p,
                "out of range"
                if not 0 <= p < pool.layout.num_pages
                else pool.store.tp_page_state(p),
            )
            for p in pages
        ]
        bad = [(p, st) for p, st in bad if st != want]
        also = set(exclude or ())
        bad += [(p, "also in the map list") for p in pages if p in also]
        if bad or len(set(pages)) != len(pages):
            self._divergences += 1
            self._fail(
                TpDivergenceError(
                    f"{pool.name}: TP rank {self.rank}: rank 0's {what} list at exchange "
                    f"#{self._exchanges} ({_KIND_NAMES[kind]} {pages} for {short}) does not "
                    f"fit this rank: expected every page {want}, found "
                    f"{', '.join(f'page {p} {st}' for p, st in bad) or 'a page twice'}"
                )
            )

    def _fail(self, error: TpError) -> None:
        self._failed = error
        self._last_error = str(error)
        raise error

    def _describe_own(self, kind: int) -> str:
        code, n = self._op
        op = f"during op #{self._ops_done + 1} {_OP_NAMES[code]}(n={n})" if code else "between ops"
        return f"{_KIND_NAMES[kind]} {op}"


def _describe(v: list[int]) -> str:
    i = _IDX
    code, n = divmod(v[i["op_n"]], 1 << 32)
    op = f"during op #{v[i['op_seq']]} {_OP_NAMES.get(code, '?')}(n={n})" if code else "between ops"
    kind = v[i["kind"]]
    short = {MAP: f", {v[i['short']]} slots short", UNMAP: f", {v[i['short']]} pages over"}
    text = (
        f"{_KIND_NAMES.get(kind, '?')} {op}{short.get(kind, '')}; "
        f"ops done {v[i['op_seq']] - (1 if code else 0)}, occupied {v[i['occupied_slots']]} "
        f"slots, mapped {v[i['mapped_pages']]} pages ({v[i['spare_pages']]} spare), "
        f"{v[i['live_handle_sets']]} live handle sets, {v[i['reserved_pages']]} reserved ahead, trace {v[i['trace']] & _MASK:#018x}, "
        f"config {v[i['config']] & _MASK:#018x}"
    )
    if v[i["magic"]] != MAGIC:
        text += f", protocol tag {v[i['magic']]:#x} (expected {MAGIC:#x})"
    lens = {f.removesuffix("_len"): v[i[f]] for f in _LISTS}
    if any(lens.values()):
        text += ", rank 0 lists: " + ", ".join(f"{k} {n} pages" for k, n in lens.items() if n)
    if v[i["refused"]]:
        text += ", refused (CapacityError)"
    return text
