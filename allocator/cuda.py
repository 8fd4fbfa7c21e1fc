"""CUDA VMM backend over `cuda.bindings.driver`. The only module that imports cuda-python.

Driver behaviour relied on (docs/background.md#cuda-driver-facts, measured on an H200,
driver 580):
- `cuMemAddressReserve` takes address space only (1 TiB reserves fine, no device memory).
- `cuMemCreate` commits device memory when the handle is created, not when mapped;
  a handle kept unmapped still holds its memory.
- `cuMemMap` then `cuMemSetAccess` make a range usable; reading a range after
  `cuMemUnmap` faults and poisons the context, so unmapping must never race a
  live view (the pool only unmaps pages no occupied slot touches).
- `cuMemRelease` of a mapped handle is deferred by the driver until it is unmapped.

Handles, deleters and what they depend on:

    resource        made by                 undone by            depends on
    reservation     cuMemAddressReserve     cuMemAddressFree     context
    handle          cuMemCreate             cuMemRelease         context, device
    mapping         cuMemMap                cuMemUnmap           reservation, handle

torch uses the device's primary context; this backend retains that same
context and makes it current on whichever thread calls it (the background
mapper runs on its own thread), so tensors made over the mapped ranges are
usable by torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cuda.bindings import driver as drv

from allocator.backend import backend_stats, check_aligned
from allocator.errors import ClosedError, DriverError

_SUCCESS = drv.CUresult.CUDA_SUCCESS


def _error_name(err: Any) -> str:
    res, name = drv.cuGetErrorName(err)
    if res == drv.CUresult.CUDA_SUCCESS and name:
        return name.decode() if isinstance(name, bytes) else str(name)
    return f"CUresult {int(err)}"


def _error_text(err: Any) -> str:
    res, text = drv.cuGetErrorString(err)
    if res == drv.CUresult.CUDA_SUCCESS and text:
        return text.decode() if isinstance(text, bytes) else str(text)
    return ""


def _check(result: Any, op: str, address: int | None = None, detail: str = "") -> Any:
    """Unpack a cuda.bindings result tuple; raise DriverError("CUDA_ERROR_X: ...") on failure."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        text = _error_text(err)
        raise DriverError(
            op, _error_name(err), f"{text}{'; ' if text and detail else ''}{detail}", address
        )
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@dataclass(frozen=True)
class DriverCalls:
    """The bare driver of one backend's device, for measuring what the driver alone costs
    (kvledger.tools.bench): `driver` is cuda.bindings.driver, `prop` the allocation properties and
    `access` the access descriptors this backend passes to cuMemCreate and cuMemSetAccess,
    `check(result, op)` unpacks a call's result and raises DriverError on failure. Nothing
    made through it is in the backend's books: the caller undoes all of it."""

    driver: Any
    prop: Any
    access: list[Any]
    granularity: int
    check: Callable[..., Any]


@dataclass(frozen=True)
class CudaBackendState:
    """What a CUDA backend holds at one instant (`CudaBackend.debug_state`), for tests:
    `reservations` (address -> size), `mappings` (address -> (size, handle)), `handles`
    (handle -> size), `closed`."""

    reservations: dict[int, int]
    mappings: dict[int, tuple[int, int]]
    handles: dict[int, int]
    closed: bool


class _DeviceView:
    """Exposes [address, address + size) to torch through `__cuda_array_interface__`."""

    def __init__(self, address: int, size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


class CudaBackend:
    """VMM on one CUDA device. Use as a context manager or call `close()` (idempotent)."""

    name = "cuda"

    def __init__(self, device: int = 0) -> None:
        _check(drv.cuInit(0), "cuInit")
        self.device_ordinal = device
        self._device = _check(drv.cuDeviceGet(device), "cuDeviceGet", detail=f"device {device}")
        supported = _check(
            drv.cuDeviceGetAttribute(
                drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                self._device,
            ),
            "cuDeviceGetAttribute",
        )
        if not supported:
            raise DriverError(
                "CudaBackend", "CUDA_ERROR_NOT_SUPPORTED", f"device {device} has no VMM support"
            )
        self._ctx = _check(drv.cuDevicePrimaryCtxRetain(self._device), "cuDevicePrimaryCtxRetain")
        self._local = threading.local()
        self._make_current()
        self._prop = drv.CUmemAllocationProp()
        self._prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = device
        self._prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        self.granularity = int(
            _check(
                drv.cuMemGetAllocationGranularity(
                    self._prop,
                    drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                ),
                "cuMemGetAllocationGranularity",
            )
        )
        desc = drv.CUmemAccessDesc()
        desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = device
        desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [desc]
        self._lock = threading.Lock()
        self._closed = False
        self._reservations: dict[int, int] = {}
        self._handles: dict[int, Any] = {}  # int id -> CUmemGenericAllocationHandle
        self._mappings: dict[int, tuple[int, int]] = {}  # address -> (size, handle id)

    def _make_current(self) -> None:
        if getattr(self._local, "ctx_set", False):
            return
        _check(drv.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        self._local.ctx_set = True

    def _enter(self, op: str) -> None:
        if self._closed:
            raise ClosedError(f"{op}: the CUDA backend is closed")
        if not getattr(self._local, "ctx_set", False):
            self._make_current()

    # -- reservations -----------------------------------------------------------
    def reserve(self, size: int) -> int:
        check_aligned("reserve", self.granularity, size=size)
        if size == 0:
            raise ValueError("reserve: size=0, expected a positive multiple of the granularity")
        self._enter("reserve")
        ptr = _check(
            drv.cuMemAddressReserve(size, self.granularity, 0, 0),
            "cuMemAddressReserve",
            detail=f"size={size}",
        )
        address = int(ptr)
        with self._lock:
            self._reservations[address] = size
        return address

    def free_reservation(self, address: int, size: int) -> None:
        self._enter("free_reservation")
        with self._lock:
            if self._reservations.get(address) != size:
                raise DriverError(
                    "cuMemAddressFree",
                    "CUDA_ERROR_INVALID_VALUE",
                    f"no reservation of size {size} here",
                    address,
                )
            if any(address <= m < address + size for m in self._mappings):
                raise DriverError(
                    "cuMemAddressFree",
                    "CUDA_ERROR_INVALID_VALUE",
                    "the range still has mappings",
                    address,
                )
        _check(drv.cuMemAddressFree(address, size), "cuMemAddressFree", address)
        with self._lock:
            del self._reservations[address]

    # -- physical memory ----------------------------------------------------------
    def create(self, size: int) -> int:
        check_aligned("create", self.granularity, size=size)
        self._enter("create")
        handle = _check(drv.cuMemCreate(size, self._prop, 0), "cuMemCreate", detail=f"size={size}")
        hid = int(handle)
        with self._lock:
            self._handles[hid] = (handle, size)
        return hid

    def release(self, handle: int) -> None:
        self._enter("release")
        with self._lock:
            entry = self._handles.pop(handle, None)
        if entry is None:
            raise DriverError(
                "cuMemRelease", "CUDA_ERROR_INVALID_VALUE", f"unknown handle {handle!r}"
            )
        try:
            _check(drv.cuMemRelease(entry[0]), "cuMemRelease", detail=f"handle {handle}")
        except DriverError:
            with self._lock:
                self._handles[handle] = entry
            raise

    # -- mappings ---------------------------------------------------------------------
    # The three calls below run once per layer per page id on the map/unmap path, so they keep
    # their Python work to a dict lookup and one comparison before the driver call.
    def map(self, address: int, size: int, handle: int) -> None:
        g = self.granularity
        if address % g or size % g or size <= 0:
            check_aligned("map", g, address=address, size=size)
        self._enter("map")
        entry = self._handles.get(handle)
        if entry is None:
            raise DriverError(
                "cuMemMap", "CUDA_ERROR_INVALID_VALUE", f"unknown handle {handle!r}", address
            )
        (err,) = drv.cuMemMap(address, size, 0, entry[0], 0)
        if err != _SUCCESS:
            _check((err,), "cuMemMap", address, f"size={size}")
        self._mappings[address] = (size, handle)

    def set_access(self, address: int, size: int) -> None:
        g = self.granularity
        if address % g or size % g or size <= 0:
            check_aligned("set_access", g, address=address, size=size)
        self._enter("set_access")
        (err,) = drv.cuMemSetAccess(address, size, self._access, 1)
        if err != _SUCCESS:
            _check((err,), "cuMemSetAccess", address, f"size={size}")

    def unmap(self, address: int, size: int) -> None:
        g = self.granularity
        if address % g or size % g or size <= 0:
            check_aligned("unmap", g, address=address, size=size)
        self._enter("unmap")
        # The driver accepts an unmap of a reserved but unmapped range (seen on an H200, driver
        # 580); the host backend refuses it, and so does this one, from its own bookkeeping.
        mapped = self._mappings.get(address)
        if mapped is not None and mapped[0] == size:
            covered = [address]
        else:
            with self._lock:
                covered = [m for m in self._mappings if address <= m < address + size]
            if sum(self._mappings[m][0] for m in covered) != size or any(
                m + self._mappings[m][0] > address + size for m in covered
            ):
                raise DriverError(
                    "cuMemUnmap",
                    "CUDA_ERROR_INVALID_VALUE",
                    f"range of {size} bytes is not exactly whole mappings",
                    address,
                )
        (err,) = drv.cuMemUnmap(address, size)
        if err != _SUCCESS:
            _check((err,), "cuMemUnmap", address, f"size={size}")
        for m in covered:
            self._mappings.pop(m, None)

    def synchronize(self) -> None:
        """Wait until every operation queued so far in this device's primary context (torch's
        streams among them, whatever thread queued it) has completed: `cuCtxSynchronize`.
        What an unmap of pages still in use waits for first (the store's `close()`)."""
        self._enter("synchronize")
        _check(drv.cuCtxSynchronize(), "cuCtxSynchronize")

    # -- tensors and truth ------------------------------------------------------------
    def byte_tensor(self, address: int, size: int) -> Any:
        import torch

        self._enter("byte_tensor")
        return torch.as_tensor(_DeviceView(address, size), device=f"cuda:{self.device_ordinal}")

    def stats(self) -> dict[str, int]:
        with self._lock:
            sizes = [size for _, size in self._handles.values()]
            return backend_stats(self._reservations, sizes, len(self._mappings))

    def debug_state(self) -> CudaBackendState:
        """A copy of the backend's books (`CudaBackendState`), for tests."""
        with self._lock:
            return CudaBackendState(
                reservations=dict(self._reservations),
                mappings=dict(self._mappings),
                handles={hid: size for hid, (_, size) in self._handles.items()},
                closed=self._closed,
            )

    def driver_calls(self) -> DriverCalls:
        """The bare driver of this backend's device (`DriverCalls`), its context made current
        on the calling thread."""
        self._enter("driver_calls")
        return DriverCalls(drv, self._prop, self._access, self.granularity, _check)

    # -- lifetime -----------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unmap, release and free whatever is still held, then drop the context. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            mappings, handles, reservations = (
                dict(self._mappings),
                dict(self._handles),
                dict(self._reservations),
            )
            self._mappings.clear()
            self._handles.clear()
            self._reservations.clear()
        _check(drv.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        errors: list[DriverError] = []
        if mappings:  # work queued on them may not have run: let it, or it faults (fence rule)
            try:
                _check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
            except DriverError as e:
                errors.append(e)
        for address, (size, _) in mappings.items():
            try:
                _check(drv.cuMemUnmap(address, size), "cuMemUnmap", address)
            except DriverError as e:
                errors.append(e)
        for hid, (handle, _) in handles.items():
            try:
                _check(drv.cuMemRelease(handle), "cuMemRelease", detail=f"handle {hid}")
            except DriverError as e:
                errors.append(e)
        for address, size in reservations.items():
            try:
                _check(drv.cuMemAddressFree(address, size), "cuMemAddressFree", address)
            except DriverError as e:
                errors.append(e)
        _check(drv.cuDevicePrimaryCtxRelease(self._device), "cuDevicePrimaryCtxRelease")
        if errors:
            raise errors[0]

    def __enter__(self) -> CudaBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
