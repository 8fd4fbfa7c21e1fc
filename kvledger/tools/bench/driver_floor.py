"""The bare CUDA driver's cost of mapping one page id across a pool's layers (`kvledger bench
alloc` sets kvledger's pool beside it).

Raw cuda.bindings calls, reached through `CudaBackend.driver_calls()` (allocator.cuda stays the
only importer of cuda-python), with no kvledger code in between the timed calls.
"""

from __future__ import annotations

import time
from typing import Any


def driver_floor_seconds(
    backend: Any, *, layers: int, page_bytes: int, repeats: int, naive: bool
) -> list[float]:
    """Per page id, the seconds of mapping it across `layers` buffers: cuMemMap +
    cuMemSetAccess on handles created beforehand (pooled), or cuMemCreate + cuMemMap +
    cuMemSetAccess (naive). Each timed map is undone (unmap, and release when naive)
    untimed; everything made here is freed before it returns. `backend`: a CudaBackend."""
    calls = backend.driver_calls()
    drv, check, prop, access = calls.driver, calls.check, calls.prop, calls.access
    size = page_bytes * repeats
    bases = [
        int(check(drv.cuMemAddressReserve(size, calls.granularity, 0, 0), "cuMemAddressReserve"))
        for _ in range(layers)
    ]
    pooled = (
        []
        if naive
        else [check(drv.cuMemCreate(page_bytes, prop, 0), "cuMemCreate") for _ in range(layers)]
    )
    out: list[float] = []
    try:
        for r in range(repeats):
            t0 = time.perf_counter()
            handles = (
                [check(drv.cuMemCreate(page_bytes, prop, 0), "cuMemCreate") for _ in range(layers)]
                if naive
                else pooled
            )
            for layer in range(layers):
                addr = bases[layer] + r * page_bytes
                check(drv.cuMemMap(addr, page_bytes, 0, handles[layer], 0), "cuMemMap", addr)
                check(drv.cuMemSetAccess(addr, page_bytes, access, 1), "cuMemSetAccess", addr)
            out.append(time.perf_counter() - t0)
            for layer in range(layers):
                check(drv.cuMemUnmap(bases[layer] + r * page_bytes, page_bytes), "cuMemUnmap")
            if naive:
                for h in handles:
                    check(drv.cuMemRelease(h), "cuMemRelease")
    finally:
        for h in pooled:
            drv.cuMemRelease(h)
        for b in bases:
            drv.cuMemAddressFree(b, size)
    return out
