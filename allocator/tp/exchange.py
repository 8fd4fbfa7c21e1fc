"""One TP rank's end of the exchange: its view, the all_gather, and the checks on what came back.

The protocol (when ranks talk, what rank 0 decides, how a divergence is caught) is in
allocator.tp.coordinator's docstring; this module is its wire side. A view is `VIEW_WORDS` int64 words:
one per field of `_FIELDS`, then up to `PLAN_WORDS` page ids of rank 0's lists (publish, map,
reserve, in that order); longer lists take extra rounds of the same size. `TpExchange` keeps
the rank's position in the shared operation sequence (operations done, the one in progress,
a digest of every result), sends its view, reads rank 0's lists back, compares every view
with rank 0's and checks that rank 0's lists fit this rank's pool. The first divergence or
peer failure is kept: every later operation is refused with it.
"""

from __future__ import annotations

import array
import contextlib
import datetime
import hashlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from accounting.tp_status import TpStatus
from allocator.errors import KvAllocatorError

if TYPE_CHECKING:
    from allocator.slots.pool import SwaPool
    from allocator.tp.pages import TpPages

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


def config_digest(pool: SwaPool, ahead_pages: int) -> int:
    """What must be equal on every rank, as one word of the view."""
    return _digest(0, (*pool.tp_config(), ahead_pages))


class TpExchange:
    """This rank's end of the exchange over `group` (a gloo group; dropped by `release()` if
    `own_group`). The state of `pool`'s store is read through `pages` (its TP side) and
    checked against rank 0's lists; `config` is `config_digest(pool, ahead_pages)`. Each
    exchange waits at most `timeout_s`."""

    def __init__(
        self,
        pool: SwaPool,
        pages: TpPages,
        dist: Any,
        group: Any,
        *,
        own_group: bool,
        timeout_s: float,
        config: int,
    ) -> None:
        self._dist = dist
        self.pool = pool
        self.pages = pages
        self._group = group
        self._own_group = own_group
        self.timeout_s = timeout_s
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._config = config
        self._ops_done = 0
        self._op = (0, 0)  # (op code, size) of the operation in progress
        self._trace = 0
        self.exchanges = 0
        self._page_ops = 0
        self._divergences = 0
        self._peer_failures = 0
        self.failed: TpError | None = None
        self._last_error = ""

    # -- the rank's position in the operation sequence ------------------------------------
    def refuse_if_failed(self) -> None:
        if self.failed is not None:
            raise type(self.failed)(f"refused: this TP group failed earlier: {self.failed}")

    def op_started(self, op: str, n: int) -> None:
        self.refuse_if_failed()
        self._op = (_OP_CODES[op], n)

    def op_done(self, ids: list[int]) -> None:
        code, n = self._op
        self._trace = _digest(_digest(self._trace, (code, n)), ids)
        self._ops_done += 1
        self._op = (0, 0)

    def status(self) -> TpStatus:
        return TpStatus(
            rank=self.rank,
            size=self.size,
            exchanges_total=self.exchanges,
            page_ops_total=self._page_ops,
            divergences_total=self._divergences,
            peer_failures_total=self._peer_failures,
            last_error=self._last_error,
        )

    def release(self) -> None:
        """Drop the group if this rank created it. Idempotent."""
        if self._own_group and self._group is not None:
            group, self._group = self._group, None
            # A group whose collective timed out may refuse a clean teardown; the process
            # is failing anyway, so the error would only hide the one worth reading.
            with contextlib.suppress(Exception):
                self._dist.destroy_process_group(group)

    # -- the exchange ----------------------------------------------------------------------
    def _view(self, kind: int, short: int, lists: list[list[int]], refused: bool) -> list[int]:
        st = self.pages.state()
        code, n = self._op
        op_seq = self._ops_done + (1 if code else 0)
        view = [
            MAGIC,
            self.rank,
            self.exchanges,
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

    def exchange(
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
        self.exchanges += 1
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
                    f"#{self.exchanges} ({self._describe_own(kind)}) failed after "
                    f"{time.monotonic() - t0:.1f} s: a rank died or did not answer within "
                    f"timeout_s={self.timeout_s:g}: {e}"
                )
            )
        return [o.tolist() for o in out]

    # -- checks ----------------------------------------------------------------------------
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

    def check_pages(
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
                "out of range" if not 0 <= p < pool.layout.num_pages else self.pages.page_state(p),
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
                    f"#{self.exchanges} ({_KIND_NAMES[kind]} {pages} for {short}) does not "
                    f"fit this rank: expected every page {want}, found "
                    f"{', '.join(f'page {p} {st}' for p, st in bad) or 'a page twice'}"
                )
            )

    def _fail(self, error: TpError) -> None:
        self.failed = error
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
