"""Tensor parallelism: one SwaPool per TP rank; rank 0 decides the pages, the peers follow.

What is deterministic, what is not
    SGLang's schedulers on all TP ranks run the same allocation sequence: the same
    `alloc(n)` and `free(ids)` calls in the same order. A pool's choice of slot ids is a
    function of that sequence and of its page state (which pages are mapped, in which
    order they became spare). Same code on every rank (int sets and insertion-ordered
    dicts evolve identically), so given the same page operations at the same points of
    the sequence every rank hands out the same ids in the same order. A
    `BackgroundMapper` is timing-dependent: it maps and unmaps when its thread gets to
    it. Which spare pages exist when an alloc runs would then depend on thread timing on
    rank 0, and no peer could reproduce rank 0's ids without an exchange on every alloc.
    So a pool under TP takes no background mapper (attaching one is refused both ways):
    every page change happens inside an alloc or a free.

When ranks talk
    A page changes at exactly two points, and every rank sees from its own state that it
    has reached one:
    - an alloc that the free slots of mapped pages cannot meet: pages must be mapped;
    - a free that leaves more than `max_spare_pages` spare pages: some must be unmapped.
    There every rank joins one exchange: an all_gather, over a CPU gloo group, of one
    fixed-size int64 view per rank (`VIEW_WORDS` words). Rank 0's view carries its plan:
    the page ids its own policy chose to map or unmap, or its refusal (CapacityError;
    then every rank raises it and nothing changes). A peer applies that plan instead of
    planning (its policy is off), mapping or unmapping the page in every layer on its own
    backend, then finishes the operation with the same code rank 0 runs. An operation
    that changes no page exchanges nothing; one that does costs one collective, never one
    per layer. A plan longer than `PLAN_WORDS` pages takes extra rounds of the same size.
    At attach, a first exchange compares the pools' configurations.

Divergence
    Each view also carries the rank's position (operations done, exchanges done), the
    current operation (kind, size, slots short or pages over), its pool state (occupied
    slots, mapped and spare pages, live handle sets) and a hash of every result so far
    (the ids each alloc handed out and each free returned). Every rank compares every
    view with rank 0's; on any difference every rank counts it (`TpStatus`), raises
    `TpDivergenceError` naming each differing rank's view next to rank 0's, and refuses
    every later operation. A divergence is caught at the first exchange after it;
    operations between the two are not checked: `verify()` forces an exchange (call it
    once per scheduler step for a strict mode, at one collective per step).

A rank that dies or hangs
    Each exchange waits at most `timeout_s`; a dead peer's closed connection fails at
    once. Either raises `TpPeerError` on the ranks still alive, counted in `TpStatus`,
    and the coordinator refuses every later operation.
"""

from __future__ import annotations

import array
import contextlib
import datetime
import hashlib
import time
from collections.abc import Sequence
from typing import Any

from accounting.tp_status import TpStatus
from allocator.errors import CapacityError, KvAllocatorError
from allocator.pool import SwaPool

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
    "trace",
    "config",
    "refused",
    "plan_len",
)
_IDX = {name: i for i, name in enumerate(_FIELDS)}
_COMPARED = tuple(f for f in _FIELDS if f not in ("rank", "refused", "plan_len"))
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
    ) -> None:
        import torch.distributed as dist

        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s={timeout_s!r}, expected a positive number of seconds")
        if pool.closed:
            raise ValueError(f"pool {pool.name!r} is closed, expected an open pool")
        if pool._mapper is not None:
            raise ValueError(
                f"pool {pool.name!r} has a background mapper, expected none: under TP its "
                "timing would decide rank 0's slot ids (see allocator.tp)"
            )
        if pool._tp is not None:
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
        self._config = _digest(0, pool.tp_config())
        if ledger is not None:
            have = ledger.labels.get("tp_rank")
            if have is not None and have != str(self.rank):
                raise ValueError(
                    f"ledger label tp_rank={have!r}, expected {str(self.rank)!r} (this rank)"
                )
            ledger.labels["tp_rank"] = str(self.rank)
            ledger.set_tp_status(self.status)
        with pool._lock:
            pool._tp = self
            try:
                self._exchange(HELLO, 0)
            except BaseException:
                pool._tp = None
                self._release_group()
                raise

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

    def plan_map(self, need: int) -> list[int]:
        """Page ids to map so that `need` more slots can be handed out."""
        if self.rank == 0:
            try:
                plan = self.pool._plan_pages(need)
            except CapacityError as e:
                self._exchange(MAP, need, refused=True)
                raise CapacityError(f"{e} (TP rank 0 decides; every rank refuses)") from None
            if plan is None:  # pragma: no cover - only a background mapper makes pages busy
                raise RuntimeError(f"{self.pool.name}: pages busy under TP")
            self._exchange(MAP, need, plan)
            return plan
        plan, refused = self._exchange(MAP, need)
        if refused:
            raise CapacityError(
                f"{self.pool.name}: TP rank 0 could not allocate {need} more slots "
                f"(CapacityError there); rank {self.rank} follows it, nothing changed"
            )
        self._check_plan(plan, "unmapped", MAP, need)
        return plan

    def plan_unmap(self, excess: int) -> list[int]:
        """Spare page ids to unmap, `excess` of them."""
        if self.rank == 0:
            plan = self.pool.tp_trim_plan(excess)
            self._exchange(UNMAP, excess, plan)
            return plan
        plan, _ = self._exchange(UNMAP, excess)
        self._check_plan(plan, "spare", UNMAP, excess)
        return plan

    # -- public ---------------------------------------------------------------------------
    def verify(self) -> None:
        """Exchange now and compare every rank's view with rank 0's (one collective)."""
        with self.pool._lock:
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

    def close(self) -> None:
        """Detach from the pool (it works alone again) and drop an own group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self.pool._lock:
            if self.pool._tp is self:
                self.pool._tp = None
        self._release_group()

    def __enter__(self) -> TpCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the exchange ----------------------------------------------------------------------
    def _check_attached(self, what: str) -> None:
        if self._closed or self.pool._tp is not self:
            raise TpError(f"{what}: this coordinator is closed or no longer attached")

    def _release_group(self) -> None:
        if self._own_group and self._group is not None:
            group, self._group = self._group, None
            # A group whose collective timed out may refuse a clean teardown; the process
            # is failing anyway, so the error would only hide the one worth reading.
            with contextlib.suppress(Exception):
                self._dist.destroy_process_group(group)

    def _view(self, kind: int, short: int, plan: list[int], refused: bool) -> list[int]:
        st = self.pool.tp_state()
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
            _signed64(self._trace),
            _signed64(self._config),
            int(refused),
            len(plan),
        ]
        return view + plan[:PLAN_WORDS] + [0] * (PLAN_WORDS - min(len(plan), PLAN_WORDS))

    def _exchange(
        self, kind: int, short: int, plan: list[int] | None = None, *, refused: bool = False
    ) -> tuple[list[int], bool]:
        """One all_gather of every rank's view; returns rank 0's plan and refusal."""
        plan = list(plan or [])
        self._exchanges += 1
        views = self._all_gather(self._view(kind, short, plan, refused), kind)
        self._compare(views)  # every rank sees the same views, so all raise here or none
        leader = views[0]
        n_plan = leader[_IDX["plan_len"]]
        start = len(_FIELDS)
        got = leader[start : start + min(n_plan, PLAN_WORDS)]
        while len(got) < n_plan:  # a long plan: more rounds of the same size
            rest = plan[len(got) : len(got) + PLAN_WORDS] if self.rank == 0 else []
            more = self._all_gather(rest + [0] * (VIEW_WORDS - len(rest)), kind)[0]
            got += more[: min(PLAN_WORDS, n_plan - len(got))]
        self._page_ops += n_plan
        return got, bool(leader[_IDX["refused"]])

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

    def _check_plan(self, plan: list[int], want: str, kind: int, short: int) -> None:
        pool = self.pool
        bad = [
            (p, "out of range" if not 0 <= p < pool.layout.num_pages else pool.tp_page_state(p))
            for p in plan
        ]
        bad = [(p, s) for p, s in bad if s != want]
        if bad or len(set(plan)) != len(plan):
            self._divergences += 1
            self._fail(
                TpDivergenceError(
                    f"{pool.name}: TP rank {self.rank}: rank 0's plan at exchange "
                    f"#{self._exchanges} ({_KIND_NAMES[kind]} {plan} for {short}) does not "
                    f"fit this rank: expected every page {want}, found "
                    f"{', '.join(f'page {p} {s}' for p, s in bad) or 'a page twice'}"
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
        f"{v[i['live_handle_sets']]} live handle sets, trace {v[i['trace']] & _MASK:#018x}, "
        f"config {v[i['config']] & _MASK:#018x}"
    )
    if v[i["magic"]] != MAGIC:
        text += f", protocol tag {v[i['magic']]:#x} (expected {MAGIC:#x})"
    if v[i["plan_len"]]:
        start = len(_FIELDS)
        shown = v[start : start + min(v[i["plan_len"]], 8)]
        text += f", plan {v[i['plan_len']]} pages {shown}{'...' if v[i['plan_len']] > 8 else ''}"
    if v[i["refused"]]:
        text += ", refused (CapacityError)"
    return text
