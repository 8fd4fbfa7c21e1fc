"""A host mirror of SGLang's SWA free-page list, so the bridge knows which pages an
allocation takes without reading them back from the device.

SGLang 0.5.23's `PagedTokenToKVPoolAllocator` changes `free_pages` in exactly these ways
(read in `sglang/srt/mem_cache/allocator/paged.py`):

- an allocation takes its pages from the front (`free_pages = free_pages[n:]`); how many is
  host metadata (the lengths before and after);
- `_release_page_ids(*ids)` puts the ids in front (`cat((*ids, free_pages))`), or, with
  `need_sort`, stages them (`staged_pages`);
- `merge_and_sort_free` sorts the free and staged pages into one ascending list;
- `clear` resets it to `1..num_pages`.

The mirror replays the same steps on host arrays (chunks in a deque, so a release costs no
copy of the list). It is driven by the journal (`journal`), which replays SGLang's recorded
calls once the released ids are known, and checks its length against SGLang's after every
allocation; a mismatch is a divergence, answered by reading the list again.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

Chunk = np.ndarray


class FreeListMirror:
    def __init__(self, free: np.ndarray, staged: list[np.ndarray] | None = None) -> None:
        self._chunks: deque[Chunk] = deque()
        self._len = 0
        self._staged: list[Chunk] = []
        self.reset(free, staged or [])

    def reset(self, free: np.ndarray, staged: list[np.ndarray]) -> None:
        self._chunks = deque([free]) if len(free) else deque()
        self._len = len(free)
        self._staged = list(staged)

    def __len__(self) -> int:
        return self._len

    def take(self, n: int) -> np.ndarray:
        """Pop the first `n` page ids."""
        if n > self._len:
            raise ValueError(f"take {n} pages from a mirror of {self._len}")
        parts: list[np.ndarray] = []
        need = n
        chunks = self._chunks
        while need:
            ids = chunks.popleft()
            if len(ids) > need:
                parts.append(ids[:need])
                chunks.appendleft(ids[need:])
                need = 0
            else:
                parts.append(ids)
                need -= len(ids)
        self._len -= n
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def front(self, k: int) -> np.ndarray:
        """Up to the first `k` page ids."""
        parts: list[np.ndarray] = []
        need = k
        for c in self._chunks:
            if need <= 0:
                break
            parts.append(c[:need])
            need -= len(parts[-1])
        if not parts:
            return np.zeros(0, np.int64)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def release(self, chunks: list[Chunk], *, staged: bool) -> None:
        """SGLang's `_release_page_ids(*chunks)`: in front, in order, or staged."""
        if staged:
            self._staged.extend(chunks)
            return
        for c in reversed(chunks):
            self._chunks.appendleft(c)
            self._len += len(c)

    def known(self) -> np.ndarray:
        """The whole free list in order."""
        every = list(self._chunks)
        return np.concatenate(every) if every else np.zeros(0, np.int64)

    def replace(self, free: np.ndarray) -> None:
        """The free list reordered (same ids); staged ids untouched."""
        self._chunks = deque([free]) if len(free) else deque()

    def merge_and_sort(self) -> None:
        if not self._staged:
            return
        every = [*self._chunks, *self._staged]
        merged = np.sort(np.concatenate(every)) if every else np.zeros(0, np.int64)
        self.reset(merged, [])

    def staged_count(self) -> int:
        return sum(len(c) for c in self._staged)


def host_ids(t: Any) -> np.ndarray:
    """A whole device or host tensor read to the host (attach and resync only: may sync)."""
    return np.asarray(t.detach().to("cpu").reshape(-1).numpy(), dtype=np.int64)
