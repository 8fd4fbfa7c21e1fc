"""A host-memory stand-in for vLLM 0.34's VMM driver (`vllm.utils.vmm_driver.VmmDriver`),
so that vLLM's real `ExtensibleTensor` and `ExtensibleKVCache` run on a machine without a
GPU.

Each driver call has the CUDA call's semantics, on Linux memory:

| vLLM's call (CUDA) | here |
|---|---|
| `reserve` (`cuMemAddressReserve`) | `mmap(PROT_NONE, MAP_NORESERVE)`: address space, no memory |
| `create` (`cuMemCreate`) | a memfd of that size, `posix_fallocate`d: the memory is taken at creation |
| `map` (`cuMemMap`) | `mmap(MAP_FIXED | MAP_SHARED)` of the memfd at the address, still inaccessible |
| `set_access` (`cuMemSetAccess`) | `mprotect(PROT_READ | PROT_WRITE)` |
| `unmap` (`cuMemUnmap`) | the range put back to `PROT_NONE` anonymous address space |
| `release` (`cuMemRelease`) | the memfd closed (its memory goes once unmapped) |
| `free_reserved` (`cuMemAddressFree`) | `munmap` |

A byte outside a mapped, accessible chunk faults, as on the GPU. `dlpack_device_type` is the
CPU's, so `ExtensibleTensor.full_view()` is a CPU tensor over the host reservation. The
driver keeps its own books (live chunks, their bytes, live reservations): the test's
independent truth, like NVML's on a GPU.

What it does not prove: anything of CUDA itself (granularity, the driver's own errors, the
GPU's page tables, memory torch's allocator or NVML sees). `get_vmm_driver` is replaced where
`vllm.utils.extensible_tensor` calls it, and `torch.accelerator.synchronize` (which
`release_physical` calls before unmapping, and which raises on a machine without an
accelerator) by a no-op: host memory has no stream to wait for.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_PROT_NONE, _PROT_RW = 0, 0x1 | 0x2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANON, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value
GRANULE = 2 << 20  # what CUDA reports on an H100 / H200

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _check(ok: bool, what: str) -> None:
    if not ok:
        err = ctypes.get_errno()
        raise RuntimeError(f"host VMM driver: {what} failed: {os.strerror(err)}")


class HostVmmDriver:
    """vLLM's `VmmDriver` interface, on host memory (see the module's table)."""

    dlpack_device_type = 1  # kDLCPU

    def __init__(self, granule: int = GRANULE) -> None:
        self.granule = granule
        self.reservations: dict[int, int] = {}  # base -> size
        self.chunks: dict[int, int] = {}  # handle (memfd) -> size
        self.mapped: dict[int, tuple[int, int]] = {}  # address -> (size, handle)
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    @property
    def physical_bytes(self) -> int:
        """Bytes of the chunks alive (created, not released): what the device would hold."""
        return sum(self.chunks.values())

    def granularity(self, device_index: int) -> int:
        return self.granule

    def ensure_context(self, device_index: int) -> None:
        self._count("ensure_context")

    def unusable_runtime_reason(self, device_index: int) -> str | None:
        return None

    def reserve(self, size: int) -> int:
        self._count("reserve")
        ptr = _libc.mmap(None, size, _PROT_NONE, _MAP_PRIVATE | _MAP_ANON | _MAP_NORESERVE, -1, 0)
        _check(ptr not in (None, _MAP_FAILED), f"reserve({size})")
        self.reservations[int(ptr)] = size
        return int(ptr)

    def free_reserved(self, ptr: int, size: int) -> None:
        self._count("free_reserved")
        if self.reservations.get(ptr) != size:
            raise RuntimeError(
                f"host VMM driver: free_reserved({ptr:#x}, {size}) of no reservation"
            )
        _check(_libc.munmap(ptr, size) == 0, "munmap")
        del self.reservations[ptr]

    def create(self, size: int, device_index: int, export_handle_types: int = 0) -> int:
        self._count("create")
        if size <= 0 or size % self.granule:
            raise RuntimeError(f"host VMM driver: create({size}), expected whole granules")
        fd = os.memfd_create("kvledger-host-vmm", os.MFD_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, size)
        except BaseException:
            os.close(fd)
            raise
        self.chunks[fd] = size
        return fd

    def release(self, handle: int) -> None:
        self._count("release")
        if handle not in self.chunks:
            raise RuntimeError(f"host VMM driver: release({handle}) of no chunk")
        if any(h == handle for _, h in self.mapped.values()):
            raise RuntimeError(f"host VMM driver: release({handle}) of a mapped chunk")
        os.close(handle)
        del self.chunks[handle]

    def _inside(self, ptr: int, size: int) -> bool:
        return any(b <= ptr and ptr + size <= b + s for b, s in self.reservations.items())

    def map(self, ptr: int, size: int, handle: int) -> None:
        self._count("map")
        if self.chunks.get(handle) != size or not self._inside(ptr, size):
            raise RuntimeError(f"host VMM driver: map({ptr:#x}, {size}, {handle}) does not fit")
        got = _libc.mmap(ptr, size, _PROT_NONE, _MAP_SHARED | _MAP_FIXED, handle, 0)
        _check(got == ptr, "mmap(MAP_FIXED)")
        self.mapped[ptr] = (size, handle)

    def set_access(self, ptr: int, size: int, device_index: int) -> None:
        self._count("set_access")
        if not self._inside(ptr, size):
            raise RuntimeError(f"host VMM driver: set_access({ptr:#x}, {size}) outside")
        _check(_libc.mprotect(ptr, size, _PROT_RW) == 0, "mprotect")

    def unmap(self, ptr: int, size: int) -> None:
        self._count("unmap")
        if self.mapped.get(ptr, (None,))[0] != size:
            raise RuntimeError(f"host VMM driver: unmap({ptr:#x}, {size}) of no mapping")
        flags = _MAP_PRIVATE | _MAP_ANON | _MAP_NORESERVE | _MAP_FIXED
        got = _libc.mmap(ptr, size, _PROT_NONE, flags, -1, 0)
        _check(got == ptr, "mmap(PROT_NONE)")
        del self.mapped[ptr]

    def leaks(self) -> dict[str, int]:
        """What is still held: {} once every reservation and chunk went back."""
        out = {
            "reservations": len(self.reservations),
            "chunks": len(self.chunks),
            "mappings": len(self.mapped),
        }
        return {k: v for k, v in out.items() if v}


@contextmanager
def host_vmm(monkeypatch: Any, granule: int = GRANULE) -> Iterator[HostVmmDriver]:
    """vLLM's ExtensibleTensor on a `HostVmmDriver` within the block (monkeypatch undoes it)."""
    import torch
    import vllm.utils.extensible_tensor as et

    driver = HostVmmDriver(granule)
    monkeypatch.setattr(et, "get_vmm_driver", lambda: driver)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a, **k: None)
    yield driver
