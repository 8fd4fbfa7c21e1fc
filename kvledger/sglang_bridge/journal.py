"""The journal of SGLang's free-list changes: recorded per call, replayed in batches.

What the scheduler's thread pays per hooked call is one tuple appended to `raw`: an
allocation records how many pages left the front of the free list (host metadata, the
list's length before and after) and the length after; a release records the id tensors
SGLang passed (referenced, not read); a merge records that the list was re-sorted. Nothing
is read from the device and nothing is locked on that path.

`replay` turns the recorded calls into what the follower needs, for many calls at once:

1. `drain` moves `raw` into a queue, reading the released ids of all new releases with one
   read (`reader.read_many`: on CPU a view, on CUDA one device-side concatenation, one pinned
   non-blocking copy and one event);
2. the queue is replayed in order on the host mirror of the free list (`freelist`) while
   the ids it needs are known (all of them with `wait`): an allocation pops its count from
   the mirror's front, a release pushes its ids in front (or stages them), a merge sorts;
   every allocation's recorded length is checked against the mirror's (a mismatch is a
   divergence: the replay stops and the caller re-reads SGLang's list);
3. the rows taken and given back are netted: a row released and taken again in the same
   batch never left the engine, one taken and released again never reached the follower.

`taken` (written by the scheduler's thread only) and `replayed_taken` (written under the
hooks' lock only) count rows taken since attach, so the hooks can tell, without a lock,
how many rows were handed out past the last replay.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from kvledger.sglang_bridge.freelist import FreeListMirror

TAKE, RELEASE, MERGE = 0, 1, 2
_EMPTY = np.zeros(0, np.int64)


class Divergence(Exception):
    """The mirror disagrees with what SGLang recorded; the caller re-reads SGLang's list."""


class Journal:
    def __init__(self, mirror: FreeListMirror, reader: Any) -> None:
        self.mirror = mirror
        self.reader = reader
        self.raw: list[tuple[Any, ...]] = []  # appended by the hooks, lock-free
        self._queue: deque[tuple[Any, ...]] = deque()
        self.taken = 0  # rows taken, recorded (the scheduler's thread writes it)
        self.replayed_taken = 0  # rows taken, replayed (under the hooks' lock)
        self.releases = 0  # release calls replayed
        self.doubles = 0  # rows a batch took (or gave back) twice: a divergence

    def __len__(self) -> int:
        return len(self.raw) + len(self._queue)

    def pending_merge(self) -> int | None:
        """`taken` when the first merge not replayed yet happened (rows taken after it are in
        an order the mirror does not know), or None."""
        for e in (*self._queue, *self.raw):
            if e[0] == MERGE:
                return int(e[1])
        return None

    def drain(self) -> None:
        """Move what the hooks recorded into the queue, starting the reads of released ids."""
        n = len(self.raw)
        if not n:
            return
        entries = self.raw[:n]
        del self.raw[:n]  # the hooks may append meanwhile: only what was read goes
        tensors = [t for e in entries if e[0] == RELEASE for t in e[1]]
        if not tensors:
            self._queue.extend(entries)
            return
        read, sizes = self.reader.read_many(tensors)
        k = i = 0
        for e in entries:
            if e[0] != RELEASE:
                self._queue.append(e)
                continue
            spans = []
            for _ in e[1]:
                spans.append((k, k + sizes[i]))
                k += sizes[i]
                i += 1
            self._queue.append((RELEASE, read, spans, e[2]))

    def replay(self, *, wait: bool) -> tuple[np.ndarray, np.ndarray, int]:
        """Replay the queue in order while its ids are known (every entry with `wait`).
        Returns (rows taken, rows given back, releases replayed), netted."""
        takes: list[np.ndarray] = []
        gives: list[np.ndarray] = []
        mirror = self.mirror
        q = self._queue
        releases = 0
        while q:
            e = q[0]
            kind = e[0]
            if kind == TAKE:
                n, after = e[1], e[2]
                if n > len(mirror) or len(mirror) - n != after:
                    raise Divergence(
                        f"an allocation took {n} pages leaving {after}, the mirror has "
                        f"{len(mirror)}"
                    )
                takes.append(mirror.take(n))
                self.replayed_taken += n
            elif kind == RELEASE:
                read = e[1]
                if not wait and not read.ready():
                    break
                ids = read.ids()
                chunks = [ids[a:b] for a, b in e[2]]
                mirror.release(chunks, staged=e[3])
                gives.extend(chunks)
                releases += 1
            else:
                mirror.merge_and_sort()
            q.popleft()
        self.releases += releases
        return (*self._net(takes, gives), releases)

    def _net(self, takes: list[np.ndarray], gives: list[np.ndarray]) -> tuple[Any, Any]:
        t = _cat(takes)
        g = _cat(gives)
        if not t.size or not g.size:
            return t, g
        ids = np.concatenate([t, g])
        sign = np.concatenate([np.ones(t.size, np.int64), -np.ones(g.size, np.int64)])
        rows, inv = np.unique(ids, return_inverse=True)
        net = np.bincount(inv, weights=sign, minlength=rows.size)
        self.doubles += int(np.count_nonzero(np.abs(net) > 1))
        return rows[net > 0], rows[net < 0]

    def clear(self) -> None:
        """Forget everything recorded (SGLang's list is re-read by the caller)."""
        self.raw.clear()
        self._queue.clear()
        self.replayed_taken = self.taken


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return _EMPTY
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
