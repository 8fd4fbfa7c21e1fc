"""The journal of SGLang's free-list changes: recorded per call, replayed in batches.

What the scheduler's thread pays per hooked call is one tuple appended to `raw`, nothing
read from the device and no lock:

- an allocation records the free-list tensor it took from and how many pages it took (the
  list's length before and after, host metadata). SGLang takes from the front and replaces
  its list by a view of the rest, never writing into a list in place, so the pages taken
  are that tensor's first `n` entries whenever they are read;
- a release records the id tensors SGLang passed (referenced, not read);
- a merge (`need_sort` only) records that the list was re-sorted.

Each entry also records `net` after it: rows taken minus rows released to the front of the
list since attach. SGLang's list is a stack for these calls (a release puts its ids in
front, an allocation takes from the front), so between two points in time an allocation
reached `net - net_then` rows deep into the list as it was then, or less: released rows
are taken first. The front policy bounds that depth by the rows it pinned.

`drain` turns everything recorded since the last drain into one *batch*: the taken slices,
the released tensors and the first rows of the free list as it is at that moment (the
front), all read with one `reader.read_many` (on CPU the tensors' values; on CUDA one
device-side concatenation, one pinned non-blocking copy and one event). `replay` takes the
batches whose values are there (all of them with `wait`), in order, and nets them: a row's
state after them is its last move, and only the rows whose state differs from the
follower's are returned (a row released and taken again never left the engine; one taken
and released again never reached the follower).

`net` is written by the scheduler's thread only, `replayed_net` (its value at the end of the
last batch replayed) under the policy's lock only, so the two compare them without a lock.
The recording side also keeps `calls` (hooked calls begun plus ended: odd while one runs,
so another thread can tell whether SGLang's list is between two calls) and `widest` (the
most rows one allocation took since the policy last looked, which sets how far ahead it
maps).
"""

from __future__ import annotations

from collections import deque
from typing import Any

TAKE, RELEASE, MERGE = 0, 1, 2


class Batch:
    """Recorded calls read together: `moves` is (is_take, first, end) per id tensor in order,
    indexing the read's lists; the front is the read's last list."""

    __slots__ = ("merged", "moves", "net", "peak", "read", "releases")

    def __init__(
        self, read: Any, moves: list[tuple[int, int]], net: int, peak: int | None, releases: int
    ) -> None:
        self.read = read
        self.moves = moves
        self.net = net  # journal.net after the batch's last call
        self.peak = peak  # the highest journal.net after an allocation of the batch
        self.releases = releases
        self.merged = False  # the list was re-sorted during the batch


class Journal:
    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.raw: list[tuple[Any, ...]] = []  # appended by the hooks, lock-free
        self._queue: deque[Batch] = deque()
        self.net = 0  # rows taken - rows released to the front (the scheduler's thread)
        self.calls = 0  # hooked calls begun + ended: odd while one runs (the scheduler's thread)
        self.widest = 0  # the most rows one allocation took since the policy last reset it
        self.replayed_net = 0  # `net` at the end of the last batch replayed (under the lock)
        self.releases = 0  # release calls replayed
        self._drained_net = 0  # `net` at the end of the last batch drained

    def __len__(self) -> int:
        return len(self.raw) + len(self._queue)

    def merged(self) -> bool:
        """A merge not replayed yet: rows taken after it come from a re-sorted list."""
        return any(b.merged for b in self._queue) or any(e[0] == MERGE for e in self.raw)

    def peak(self) -> int | None:
        """The highest `net` after an allocation not replayed yet (None when none): how deep
        into the front of the last batch replayed SGLang may have taken rows."""
        peaks = [b.peak for b in self._queue if b.peak is not None]
        peaks += [e[3] for e in self.raw if e[0] == TAKE]
        return max(peaks) if peaks else None

    def drain(self, front: tuple[Any, int], count: int | None = None) -> None:
        """Read what was recorded (the first `count` entries; all by default) and `front`
        (SGLang's free list right after them and how many of its first rows to read), as one
        batch."""
        n = len(self.raw) if count is None else count
        entries = self.raw[:n]
        del self.raw[:n]  # only what was read goes: the hooks may append meanwhile
        items: list[tuple[Any, int | None]] = []  # (tensor, first n or all)
        moves: list[tuple[int, int]] = []  # (is_take, index in items)
        releases = 0
        peak: int | None = None
        for e in entries:
            if e[0] == TAKE:
                moves.append((1, len(items)))
                items.append((e[1], e[2]))
                self._drained_net = e[3]
                peak = e[3] if peak is None else max(peak, e[3])
            elif e[0] == RELEASE:
                releases += 1
                for t in e[1]:
                    moves.append((0, len(items)))
                    items.append((t, None))
                self._drained_net = e[2]
        items.append(front)
        read = self.reader.read_many(items)
        batch = Batch(read, moves, self._drained_net, peak, releases)
        batch.merged = any(e[0] == MERGE for e in entries)
        self._queue.append(batch)

    def replay(self, *, wait: bool, held: Any) -> tuple[list[int], list[int], int, Any]:
        """Replay the batches whose values are there (all with `wait`), in order. Returns the
        rows to take and to give back (netted against `held`, the follower's held flags per
        row before), the releases replayed and the front of the last batch replayed (None
        when none was)."""
        last: dict[int, int] = {}  # row -> 1 if its last move was a take, 0 a release
        q = self._queue
        releases = 0
        front = None
        while q and (wait or q[0].read.ready()):
            b = q.popleft()
            lists = b.read.lists()
            for is_take, i in b.moves:
                last.update(dict.fromkeys(lists[i], is_take))
            front = lists[-1]
            releases += b.releases
            self.replayed_net = b.net
        self.releases += releases
        take = [row for row, v in last.items() if v and not held[row]]
        give = [row for row, v in last.items() if not v and held[row]]
        return take, give, releases, front

    def clear(self) -> None:
        """Forget everything recorded (the caller re-reads SGLang's allocator)."""
        self.raw.clear()
        self._queue.clear()
        self.replayed_net = self._drained_net = self.net
