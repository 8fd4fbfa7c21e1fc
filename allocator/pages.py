"""One page id across every layer buffer: reservations, handle sets, map and unmap as transactions.

A page id `p` of a pool is the byte range `[p * page_bytes, (p + 1) * page_bytes)`
of every layer's reservation. Mapping it takes one handle per layer (a "handle
set"). Each operation here either completes for every layer or undoes the
layers it did and re-raises, so a failure half way leaves nothing held.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from allocator.backend import Backend, check_aligned
from allocator.errors import DriverError


class LayerSet:
    def __init__(
        self, backend: Backend, *, layers: int, reserved_bytes: int, page_bytes: int
    ) -> None:
        if not isinstance(layers, int) or layers <= 0:
            raise ValueError(f"layers={layers!r}, expected a positive int")
        check_aligned("LayerSet", backend.granularity, page_bytes=page_bytes)
        if page_bytes == 0:
            raise ValueError("page_bytes=0, expected a positive multiple of the granularity")
        if reserved_bytes % page_bytes:
            raise ValueError(
                f"reserved_bytes={reserved_bytes}, expected a multiple of page_bytes={page_bytes}"
            )
        self.backend = backend
        self.layers = layers
        self.page_bytes = page_bytes
        self.reserved_bytes = reserved_bytes
        self.bases: list[int] = []
        try:
            for _ in range(layers):
                self.bases.append(backend.reserve(reserved_bytes))
        except BaseException:
            self.free_reservations()
            raise

    def address(self, layer: int, page: int) -> int:
        return self.bases[layer] + page * self.page_bytes

    def create_set(self) -> list[int]:
        handles: list[int] = []
        try:
            for _ in range(self.layers):
                handles.append(self.backend.create(self.page_bytes))
        except BaseException:
            self.release_set(handles)
            raise
        return handles

    def release_set(self, handles: Sequence[int]) -> None:
        """Release every handle; the first error is raised after trying them all."""
        first: BaseException | None = None
        for h in handles:
            try:
                self.backend.release(h)
            except BaseException as e:  # keep releasing the rest
                first = first or e
        if first is not None:
            raise first

    def map_page(self, page: int, handles: Sequence[int]) -> None:
        """Map `page` in every layer with `handles[layer]` and grant access; all or nothing."""
        if len(handles) != self.layers:
            raise ValueError(
                f"map_page: {len(handles)} handles, expected one per layer ({self.layers})"
            )
        done: list[int] = []
        try:
            for layer, handle in enumerate(handles):
                addr = self.address(layer, page)
                self.backend.map(addr, self.page_bytes, handle)
                done.append(addr)
                self.backend.set_access(addr, self.page_bytes)
        except BaseException:
            for addr in reversed(done):
                # the original error is the one worth raising
                with contextlib.suppress(DriverError):
                    self.backend.unmap(addr, self.page_bytes)
            raise

    def unmap_page(self, page: int, handles: Sequence[int] | None = None) -> None:
        """Unmap `page` from every layer.

        With `handles` (the set the page is mapped with) all or nothing: a failure at one layer
        maps the layers already unmapped back and re-raises, so the page stays whole and its
        slots stay usable. Without (close), best effort: every layer is tried and the first
        error is raised after."""
        if handles is None:
            first: BaseException | None = None
            for layer in range(self.layers):
                try:
                    self.backend.unmap(self.address(layer, page), self.page_bytes)
                except BaseException as e:
                    first = first or e
            if first is not None:
                raise first
            return
        done: list[int] = []
        try:
            for layer in range(self.layers):
                self.backend.unmap(self.address(layer, page), self.page_bytes)
                done.append(layer)
        except BaseException:
            for layer in reversed(done):
                addr = self.address(layer, page)
                with contextlib.suppress(DriverError):  # the original error is worth raising
                    self.backend.map(addr, self.page_bytes, handles[layer])
                    self.backend.set_access(addr, self.page_bytes)
            raise

    def byte_tensor(self, layer: int, size: int) -> Any:
        return self.backend.byte_tensor(self.bases[layer], size)

    def free_reservations(self) -> None:
        while self.bases:
            self.backend.free_reservation(self.bases.pop(), self.reserved_bytes)
