"""The row follower: an engine hands out whole rows of a layer buffer; the page store follows.

SGLang's paged allocator hands out pages of `page_size` tokens; the bridge lays its SWA
buffer out so that one engine page is one row (`row_bytes`) of every layer buffer. The
follower keeps, per row, whether the engine holds it and, per page id of the store, how
many (row, end) incidences touch it: a row adds one for the page its first byte lies in and
one for the page its last byte lies in (the same page twice when it does not straddle), so a
page is in use exactly when its count is non-zero. Both are numpy arrays, updated with a
handful of vectorised operations per call whatever the number of rows; Python work happens
only for the pages whose use changes (a page filling up from empty, or emptying).

Row 0 is the engine's padding row: held from the start, uncounted, never taken or given
back. A row taken twice or given back while not held means the engine and the follower
disagree: it is not applied, it is counted in `divergences` and logged, never raised (that
would take the engine's scheduler down for a bookkeeping error). A duplicate inside one
`take` is caught by the count check every `REPORT_EVERY` calls, which rebuilds the page
counts from the held rows.

Every take that found a page of its rows unmapped maps it on the spot: it waited on the
driver, and `waited` counts it (the background mapper, fed with `ahead`, keeps that at 0).
See docs/allocator.md.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Iterable
from typing import Any

import numpy as np

from allocator.rows.front import Front, plan
from allocator.spares import Fence
from allocator.states import PageState
from allocator.store import PageStore

log = logging.getLogger(__name__)

# Calls of up to this many rows take the scalar path: a decode step or an admission moves
# one to a few rows, and on those the dozen numpy calls of the vectorised path (each a few
# microseconds with the caches cold from the engine's own work) cost several times more
# than a loop over the rows. Both paths update the same arrays.
SMALL = 32


def as_rows(ids: Any) -> np.ndarray:
    """Row ids as a 1-D int64 numpy array: a CPU tensor is viewed, not copied."""
    if type(ids) is np.ndarray and ids.ndim == 1 and ids.dtype.kind in "iu":
        return ids  # the hooks' case: a slice of the free-list mirror, a read-back view
    if hasattr(ids, "numpy") and hasattr(ids, "device"):
        if ids.device.type != "cpu":
            raise ValueError(f"row ids on {ids.device}, expected host ids (read them back first)")
        ids = ids.numpy()
    out = np.asarray(ids)
    if out.dtype.kind not in "iu":
        if out.size == 0:
            return np.zeros(0, np.int64)
        raise TypeError(f"row ids of dtype {out.dtype}, expected an int")
    return out.reshape(-1)


class RowFollower:
    def __init__(
        self,
        store: PageStore,
        *,
        rows: int,
        row_bytes: int,
        first_row: int = 1,
        name: str = "rows",
    ) -> None:
        if not 0 < first_row < rows:
            raise ValueError(f"first_row={first_row!r}, expected 0 < first_row < {rows} (rows)")
        if rows * row_bytes > store.num_pages * store.page_bytes:
            raise ValueError(
                f"{rows} rows of {row_bytes} bytes exceed the store's "
                f"{store.num_pages} pages of {store.page_bytes} bytes"
            )
        self.store = store
        self.name = name
        self.rows = rows
        self.first_row = first_row
        self._row_bytes = row_bytes
        pb = store.page_bytes
        start = np.arange(rows, dtype=np.int64) * row_bytes
        self._pages2 = np.stack([start // pb, (start + row_bytes - 1) // pb], axis=1)
        self._pages2 = self._pages2.astype(np.intp)
        self._p0: list[int] = self._pages2[:, 0].tolist()  # the scalar path's copies
        self._p1: list[int] = self._pages2[:, 1].tolist()
        # One buffer each, seen by the scalar path (bytearray, array) and by numpy (views).
        self._held_b = bytearray(rows)
        self._held = np.frombuffer(self._held_b, dtype=np.bool_)
        self._count_a = array("q", bytes(8 * store.num_pages))
        self._count = np.frombuffer(self._count_a, dtype=np.int64)
        self.held_rows = 0
        self.divergences = 0
        self.takes = 0  # take calls that handed out at least one row
        self.give_backs = 0  # give_back calls that returned at least one row
        self.waited = 0  # takes that mapped a page on the spot: waited on the driver
        with store.lock:
            store.attach_user(self)  # one follower per store
            self._apply_take(np.zeros(1, np.int64), count=False)  # the padding row

    # -- public ------------------------------------------------------------------------------
    def take(self, ids: Any, *, count_waits: bool = True) -> int:
        """The engine handed out rows `ids`: they are held, their pages in use (mapped now if
        the mapper has not; counted in `waited` unless `count_waits` is False: a take that is
        not an allocation, like a compaction's). Returns the number of rows applied; all or
        nothing on a CapacityError or DriverError from mapping."""
        r = as_rows(ids)
        if r.size == 0:
            return 0
        store = self.store
        with store.lock:
            store.check_open("take")
            if r.size <= SMALL and self._small_ok(rl := r.tolist(), held=False):
                self._take_small(rl, count_waits)
            else:
                if r.size <= SMALL or not self._all_rows_in(r, held=False):
                    r = self._sort_out(r, want_held=False, op="take")
                    if r.size == 0:
                        return 0
                self._apply_take(r, count=True, count_waits=count_waits)
            self.takes += 1
            due = store.reporter.tick()
        if due:
            self._check_counts()
            store.safe_point()
        return int(r.size)

    def give_back(self, ids: Any, fence: Fence | None = None, *, trim: bool = True) -> int:
        """The engine returned rows `ids` to its free list. Pages that empty become spares,
        unmapped by the store's policy once `fence` (the GPU work that used them) is done
        (`trim=False`: not now; the caller applies the policy after, with
        `store.policy.after_release_locked`). Never raises for driver failures (counted by the
        store)."""
        r = as_rows(ids)
        if r.size == 0:
            return 0
        store = self.store
        with store.lock:
            store.check_open("give_back")
            if r.size <= SMALL and self._small_ok(rl := r.tolist(), held=True):
                self._give_back_small(rl, fence, trim)
            else:
                if r.size <= SMALL or not self._all_rows_in(r, held=True):
                    r = self._sort_out(r, want_held=True, op="give_back")
                    if r.size == 0:
                        return 0
                self._apply_give_back(r, fence, trim)
            self.give_backs += 1
            due = store.reporter.tick()
        if due:
            self._check_counts()
            store.safe_point()
        return int(r.size)

    def give_back_all(self, fence: Fence | None = None) -> int:
        return self.give_back(self.held(), fence)

    def held(self) -> np.ndarray:
        """The rows held now, ascending (the padding row excluded)."""
        with self.store.lock:
            return np.flatnonzero(self._held[self.first_row :]) + self.first_row

    def pages_of(self, ids: Any) -> list[int]:
        """The page ids rows `ids` touch, ascending."""
        return sorted(set(self._pages2[as_rows(ids)].ravel().tolist()))

    def ahead(self, ids: Any) -> None:
        """Rows the engine hands out next: the store's mapper maps their pages ahead."""
        p0, p1 = self._p0, self._p1
        rows = as_rows(ids).tolist()
        pages = dict.fromkeys(q for row in rows for q in (p0[row], p1[row]))  # in front order
        with self.store.lock:
            self.store.policy.set_ahead(pages)

    @property
    def row_pages(self) -> np.ndarray:
        """Per row, the pages of its first and last byte (read it, never write it)."""
        return self._pages2

    @property
    def row_bytes(self) -> int:
        return self._row_bytes

    @property
    def held_flags(self) -> bytearray:
        """One byte per row, 1 while the engine holds it (the follower's own buffer: read it,
        never write it)."""
        return self._held_b

    def front(
        self,
        rows: list[int],
        max_spares: int,
        ahead: int,
        ahead_spares: int | None = None,
        min_rows: int = 0,
    ) -> Front:
        """`allocator.rows.front.plan` for `rows` an engine hands out next, in order, against this
        follower's pages and counts (under the store's lock): (safe, pinned, ahead, warm)."""
        return plan(
            self._p0,
            self._p1,
            self._count_a,
            self.store.state,
            rows,
            max_spares,
            ahead,
            ahead_spares,
            min_rows,
        )

    def cover(self, rows: list[int]) -> list[int]:
        """Map (now, if the mapper has not) the pages of `rows` an engine may have handed out
        already, without taking them; returns those pages. Under the store's lock; a map here
        waited on the driver and is counted in `waited`."""
        pages = list(dict.fromkeys(q for row in rows for q in (self._p0[row], self._p1[row])))
        self._ensure_mapped(pages, count=True)
        return pages

    @property
    def page_counts(self) -> np.ndarray:
        """Per page id, the (row, end) incidences of held rows: non-zero exactly when the page
        is in use (read it, never write it)."""
        return self._count

    def pages_changed(self, pages: Iterable[int]) -> None:
        pass  # in-use is kept by the counts; nothing tiered here

    # -- internals ---------------------------------------------------------------------------
    # np.count_nonzero is a plain C call; ndarray.any/all/min/max go through Python wrappers
    # that cost several times more on these few-element arrays.
    def _all_rows_in(self, r: np.ndarray, *, held: bool) -> bool:
        """Every id of `r` a takeable row (not the padding row, in range) that is held (or
        not held); duplicates inside one call are left to `_check_counts`."""
        try:
            h = self._held[r]
        except IndexError:
            return False
        if np.count_nonzero(r < self.first_row):
            return False
        return np.count_nonzero(h) == (r.size if held else 0)

    def _small_ok(self, rows: list[int], *, held: bool) -> bool:
        """The scalar `_all_rows_in`, duplicates included (they go to `_sort_out`)."""
        h, lo, hi, want = self._held_b, self.first_row, self.rows, int(held)
        for p in rows:
            if not lo <= p < hi or h[p] != want:
                return False
        return len(rows) == 1 or len(set(rows)) == len(rows)

    def _take_small(self, rows: list[int], count_waits: bool) -> None:
        count, p0, p1 = self._count_a, self._p0, self._p1
        fresh = [q for row in rows for q in (p0[row], p1[row]) if not count[q]]
        if fresh:
            self._use_fresh(sorted(set(fresh)), count=count_waits)
        h = self._held_b
        for row in rows:
            h[row] = 1
            count[p0[row]] += 1
            count[p1[row]] += 1
        self._took(len(rows))

    def _give_back_small(self, rows: list[int], fence: Fence | None, trim: bool) -> None:
        count, p0, p1, h = self._count_a, self._p0, self._p1, self._held_b
        emptied: list[int] = []
        for row in rows:
            h[row] = 0
            a, b = p0[row], p1[row]
            count[a] -= 1
            count[b] -= 1
            if not count[a]:
                emptied.append(a)
            if b != a and not count[b]:
                emptied.append(b)
        self._released(sorted(emptied), len(rows), fence, trim)

    def _apply_take(self, r: np.ndarray, *, count: bool, count_waits: bool = True) -> None:
        touch = self._pages2[r].ravel()
        before = self._count[touch]
        if np.count_nonzero(before) != touch.size:  # a page goes from unused to used: map it
            fresh = sorted(set(touch[before == 0].tolist()))  # a few pages: cheaper than np.unique
            self._use_fresh(fresh, count=count and count_waits)
        # bincount adds repeated pages (two rows in one page) like np.add.at, at a third of
        # its cost on these short arrays
        self._count += np.bincount(touch, minlength=self._count.size)
        self._held[r] = True
        if count:
            self._took(int(r.size))

    def _use_fresh(self, fresh: list[int], *, count: bool) -> None:
        """Pages going from unused to used: mapped (now, if the mapper has not), in use."""
        store = self.store
        self._ensure_mapped(fresh, count=count)
        for p in fresh:
            store.set_use(p, True)
        if store.mapper is not None and len(store.spares) < store.policy.max_spare_pages:
            store.cond.notify_all()  # spares were used up: the mapper maps the next ahead

    def _took(self, n: int) -> None:
        store = self.store
        self.held_rows += n
        store.reporter.add_occupied(n)
        if len(store.spares) < store.policy.min_spare_pages:
            store.cond.notify_all()

    def _ensure_mapped(self, pages: list[int], *, count: bool) -> None:
        """Map what is not mapped yet; a take that had to (or waited for the mapper to
        finish one) waited on the driver and is counted (the padding row's is not)."""
        # The store's bytearray, not a numpy view: a numpy scalar compared with a PageState
        # member takes numpy's generic path, about 7 us a comparison here against 0.05 us.
        store, state = self.store, self.store.state
        mapped, busy = PageState.MAPPED, PageState.BUSY
        waited = False
        try:
            while True:
                missing = [p for p in pages if state[p] != mapped]
                if not missing:
                    return
                waited = True
                if any(state[p] == busy for p in missing):
                    store.cond.wait(timeout=1.0)  # the mapper is on it
                    store.check_open("take")
                    continue
                store.map_locked(missing, f"take rows ({len(missing)} new page ids)")
                return
        finally:
            if waited and count:
                self.waited += 1

    def _apply_give_back(self, r: np.ndarray, fence: Fence | None, trim: bool) -> None:
        touch = self._pages2[r].ravel()
        self._held[r] = False
        self._count -= np.bincount(touch, minlength=self._count.size)
        after = self._count[touch]
        emptied: list[int] = []
        if np.count_nonzero(after) != touch.size:
            emptied = sorted(set(touch[after == 0].tolist()))
        self._released(emptied, int(r.size), fence, trim)

    def _released(self, emptied: list[int], n: int, fence: Fence | None, trim: bool) -> None:
        store = self.store
        if emptied:
            for p in emptied:
                store.set_use(p, False)
            if fence is not None:
                store.policy.fence(emptied, fence)
        self.held_rows -= n
        store.reporter.add_occupied(-n)
        if trim:
            store.policy.after_release_locked()

    def _sort_out(self, r: np.ndarray, *, want_held: bool, op: str) -> np.ndarray:
        out: list[int] = []
        seen: set[int] = set()
        bad: list[int] = []
        for p in r.tolist():
            if not self.first_row <= p < self.rows or p in seen:
                bad.append(p)
                continue
            seen.add(p)
            if bool(self._held[p]) != want_held:
                bad.append(p)
                continue
            out.append(p)
        if bad:
            self._diverged(len(bad))
            state = "not held (foreign or double give-back)" if want_held else "already held"
            log.warning(
                "%s: %s of rows %s skipped: %s or outside [%d, %d); the engine and the "
                "follower disagree",
                self.name,
                op,
                bad[:16],
                state,
                self.first_row,
                self.rows,
            )
        return np.asarray(out, dtype=np.int64)

    def _diverged(self, n: int) -> None:
        self.divergences += n

    def _check_counts(self) -> None:
        """Every REPORT_EVERY calls: the held rows match the count (a duplicate inside one
        take breaks it); if not, count the divergence and rebuild the page counts."""
        store = self.store
        with store.lock:
            held = int(np.count_nonzero(self._held[self.first_row :]))
            if held == self.held_rows or store.closed:
                return
            log.warning(
                "%s: %d rows held but %d counted (a row taken twice in one call); rebuilding",
                self.name,
                held,
                self.held_rows,
            )
            self._diverged(abs(self.held_rows - held))
            store.reporter.add_occupied(held - self.held_rows)
            self.held_rows = held
            count = np.bincount(self._pages2[self._held].ravel(), minlength=store.num_pages)
            for p in np.flatnonzero((count == 0) & (self._count != 0)).tolist():
                store.set_use(p, False)
            self._count[:] = count
            store.policy.after_release_locked()
