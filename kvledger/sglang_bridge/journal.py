"""The journal of SGLang's free-list changes: recorded per call, replayed in batches.

What the scheduler's thread pays per hooked call is one tuple appended to `raw`, nothing
read from the device and no lock:

- an allocation records the free-list tensor it took from, how many pages it took (the
  list's length before and after, host metadata) and `taken` after it. SGLang takes from the front and replaces
  its list by a view of the rest, never writing into a list in place, so the pages taken
  are that tensor's first `n` entries whenever they are read;
- a release records the id tensors SGLang passed (referenced, not read);
- a merge (`need_sort` only) records how many rows had been taken when it re-sorted.

`drain` turns everything recorded since the last drain into one *batch*: the taken slices,
the released tensors and the first rows of the free list as it is at that moment (the
front), all read with one `reader.read_many` (on CPU the tensors' values; on CUDA one
device-side concatenation, one pinned non-blocking copy and one event). `replay` takes the
batches whose values are there (all of them with `wait`), in order, and nets them: a row's
state after them is its last move, and only the rows whose state differs from the
follower's are returned (a row released and taken again never left the engine; one taken
and released again never reached the follower).

`taken` (written by the scheduler's thread only) and `replayed_taken` (written under the
hooks' lock only) count rows taken since attach, so the hooks can tell, without a lock,
how many rows were handed out past the batch the follower knows.
"""

from __future__ import annotations

from collections import deque
from typing import Any

TAKE, RELEASE, MERGE = 0, 1, 2


class Batch:
    """Recorded calls read together: `moves` is (is_take, first, end) per id tensor in order,
    indexing the read's lists; the front is the read's last list."""

    __slots__ = ("moves", "read", "releases", "taken")

    def __init__(self, read: Any, moves: list[tuple[int, int]], taken: int, releases: int):
        self.read = read
        self.moves = moves
        self.taken = taken  # journal.taken after the batch's last call
        self.releases = releases


class Journal:
    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.raw: list[tuple[Any, ...]] = []  # appended by the hooks, lock-free
        self._queue: deque[Batch] = deque()
        self.taken = 0  # rows taken, recorded (the scheduler's thread writes it)
        self.replayed_taken = 0  # rows taken in the batches replayed (under the hooks' lock)
        self.releases = 0  # release calls replayed
        self._drained_taken = 0  # `taken` as of the last allocation drained

    def __len__(self) -> int:
        return len(self.raw) + len(self._queue)

    def pending_merge(self) -> int | None:
        """`taken` when the first merge not replayed yet happened (rows taken after it come
        from a re-sorted list), or None."""
        for e in self.raw:
            if e[0] == MERGE:
                return int(e[1])
        return None

    def drain(self, front: tuple[Any, int]) -> None:
        """Read everything recorded so far, and `front` (SGLang's free list now and how many
        of its first rows to read), as one batch."""
        n = len(self.raw)
        entries = self.raw[:n]
        del self.raw[:n]  # only what was read goes: the hooks may append meanwhile
        items: list[tuple[Any, int | None]] = []  # (tensor, first n or all)
        moves: list[tuple[int, int]] = []  # (is_take, index in items)
        releases = 0
        for e in entries:
            if e[0] == TAKE:
                moves.append((1, len(items)))
                items.append((e[1], e[2]))
                self._drained_taken = e[3]
            elif e[0] == RELEASE:
                releases += 1
                for t in e[1]:
                    moves.append((0, len(items)))
                    items.append((t, None))
        items.append(front)
        read = self.reader.read_many(items)
        self._queue.append(Batch(read, moves, self._drained_taken, releases))

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
            self.replayed_taken = b.taken
        self.releases += releases
        take = [row for row, v in last.items() if v and not held[row]]
        give = [row for row, v in last.items() if not v and held[row]]
        return take, give, releases, front

    def clear(self) -> None:
        """Forget everything recorded (the caller re-reads SGLang's allocator)."""
        self.raw.clear()
        self._queue.clear()
        self.replayed_taken = self._drained_taken = self.taken
