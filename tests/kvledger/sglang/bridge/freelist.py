"""A stand-in for SGLang 0.5.23's PagedTokenToKVPoolAllocator's free list (no sglang): the
six methods the bridge wraps, with the same list semantics (allocations take from the front
and replace the list by a view of the rest; releases go in front, or are staged with
`need_sort` until a merge sorts them in). The real class is in the `sglang` tests."""

from __future__ import annotations

from typing import Any

import torch


class FreeList:
    def __init__(self, pages: int, *, need_sort: bool = False) -> None:
        self.num_pages = pages
        self.page_size = 256
        self.need_sort = need_sort
        self.staged_pages: list[Any] = []
        self.clear()

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        self.staged_pages = []

    def get_all_free_pages(self) -> Any:
        return torch.cat((self.free_pages, *self.staged_pages))

    def merge_and_sort_free(self) -> None:
        if self.staged_pages:
            self.free_pages, _ = torch.sort(self.get_all_free_pages())
            self.staged_pages = []

    def _take(self, n: int) -> Any:
        if n > len(self.free_pages):
            self.merge_and_sort_free()
        if n > len(self.free_pages):
            return None
        out = self.free_pages[:n]
        self.free_pages = self.free_pages[n:]
        return out

    def alloc(self, n: int) -> Any:
        return self._take(n)

    def alloc_extend(self, n: int) -> Any:
        return self._take(n)

    def alloc_decode(self, n: int) -> Any:
        return self._take(n)

    def _release_page_ids(self, *page_ids: Any) -> None:
        if self.need_sort:
            self.staged_pages.extend(page_ids)
        else:
            self.free_pages = torch.cat((*page_ids, self.free_pages))

    def held(self) -> list[int]:
        free = set(self.get_all_free_pages().tolist())
        return [p for p in range(1, self.num_pages + 1) if p not in free]
