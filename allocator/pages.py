"""One page id across every layer buffer: reservations, handle sets, map and unmap as transactions.

A page id `p` of a pool is the byte range `[p * page_bytes, (p + 1) * page_bytes)`
of every layer's reservation. Mapping it takes one handle per layer (a "handle
set"). Each operation here either completes for every layer or undoes the
layers it did (allocator.transaction) and re-raises, so a failure half way leaves nothing
held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from allocator.backend import Backend, check_aligned
from allocator.transaction import Transaction


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
        bases: list[int] = []
        with Transaction() as t:
            for _ in range(layers):
                base = backend.reserve(reserved_bytes)
                t.append(backend.free_reservation, base, reserved_bytes)
                bases.append(base)
            t.commit()
        self.bases = bases

    def address(self, layer: int, page: int) -> int:
        """Where page id `page` starts in layer `layer`'s reservation."""
        return self.bases[layer] + page * self.page_bytes

    def create_set(self) -> list[int]:
        """One new handle per layer; all or none."""
        handles: list[int] = []
        with Transaction() as t:
            for _ in range(self.layers):
                handle = self.backend.create(self.page_bytes)
                t.append(self.backend.release, handle)
                handles.append(handle)
            t.commit()
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
        with Transaction() as t:
            for layer, handle in enumerate(handles):
                addr = self.address(layer, page)
                self.backend.map(addr, self.page_bytes, handle)
                t.append(self.backend.unmap, addr, self.page_bytes)
                self.backend.set_access(addr, self.page_bytes)
            t.commit()

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
        with Transaction() as t:
            for layer in range(self.layers):
                addr = self.address(layer, page)
                self.backend.unmap(addr, self.page_bytes)
                t.append(self._map_layer, addr, handles[layer])
            t.commit()

    def _map_layer(self, address: int, handle: int) -> None:
        self.backend.map(address, self.page_bytes, handle)
        self.backend.set_access(address, self.page_bytes)

    def byte_tensor(self, layer: int, size: int) -> Any:
        """A uint8 tensor over the first `size` bytes of layer `layer`'s reservation."""
        return self.backend.byte_tensor(self.bases[layer], size)

    def free_reservations(self) -> None:
        """Free every layer's reservation (its pages unmapped first). Idempotent."""
        while self.bases:
            self.backend.free_reservation(self.bases.pop(), self.reserved_bytes)
