"""Host VMM backend: the CUDA VMM semantics over Linux memfd + mmap.

- A reservation is an anonymous PROT_NONE, MAP_NORESERVE mapping: address
  space only, and touching it faults (SIGSEGV), as an unmapped CUDA VA does.
- Physical memory is one memfd per backend (the "arena"). `create` fallocates a
  range of it, so the blocks are committed at once, like cuMemCreate; the
  handle is that range. `release` punches the range out (deferred while it is
  still mapped), and the memfd's allocated blocks drop.
- `map` places the memfd range over the reservation with MAP_FIXED but
  PROT_NONE; `set_access` makes it readable and writable; `unmap` puts the
  inaccessible reservation back.

`physical_bytes()` reads the truth from the kernel: `fstat(memfd).st_blocks * 512`.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any

from allocator.backend import DEFAULT_GRANULARITY, backend_stats, check_aligned
from allocator.errors import ClosedError, DriverError

_PROT_NONE = 0
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_SHARED = mmap.MAP_SHARED
_MAP_PRIVATE = mmap.MAP_PRIVATE
_MAP_ANONYMOUS = mmap.MAP_ANONYMOUS
_MAP_FIXED = 0x10  # linux/mman.h
_MAP_NORESERVE = 0x4000  # linux/mman.h
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_MAP_FAILED = ctypes.c_void_p(-1).value

# The C library's mmap, munmap, mprotect and fallocate, called by name through this module
# global (tests replace it to make one call fail).
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]

# Memory maps (VMAs) left for the rest of the process: each mapped page costs up to two
# (itself and the split of the reservation around it), and at vm.max_map_count every mmap
# in the process fails, Python's own allocator included (MemoryError anywhere). `map`
# refuses (ENOMEM) before the process count gets within this many of the limit.
MAP_COUNT_HEADROOM = 4096
_DEFAULT_MAX_MAP_COUNT = 65530  # Linux's default vm.max_map_count


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count", "rb") as f:
            return int(f.read(32))
    except (OSError, ValueError):
        return _DEFAULT_MAX_MAP_COUNT


def _process_map_count() -> int:
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


def _errno_error(op: str, address: int | None, detail: str = "") -> DriverError:
    err = ctypes.get_errno()
    return DriverError(
        op, errno.errorcode.get(err, f"errno {err}"), detail or os.strerror(err), address
    )


@dataclass(frozen=True)
class HostBackendState:
    """What a host backend holds at one instant (`HostBackend.debug_state`), for tests.

    `reservations`: address -> size of each reservation; `mappings`: address -> (size,
    handle) of each mapping; `handles`: handle -> (arena offset, size, mappings using it,
    released and waiting for its last unmap); `physical_bytes`: the memfd's allocated
    blocks (the kernel's figure, 0 once closed); `memfd`: (st_dev, st_ino) of the memfd, to
    find it in /proc, or None once closed."""

    reservations: dict[int, int]
    mappings: dict[int, tuple[int, int]]
    handles: dict[int, tuple[int, int, int, bool]]
    physical_bytes: int
    memfd: tuple[int, int] | None


@dataclass
class _Handle:
    offset: int
    size: int
    mapped: int = 0  # how many mappings use it
    released: bool = False


class HostBackend:
    """memfd + mmap backend. Use as a context manager or call `close()` (idempotent)."""

    name = "host"

    def __init__(self, granularity: int = DEFAULT_GRANULARITY) -> None:
        page = mmap.PAGESIZE
        if granularity <= 0 or granularity % page:
            raise ValueError(f"granularity={granularity!r}, expected a positive multiple of {page}")
        self.granularity = granularity
        self._lock = threading.Lock()
        self._fd: int | None = os.memfd_create("kvledger-physical", os.MFD_CLOEXEC)
        self._arena_size = 0
        self._free_offsets: dict[int, list[int]] = {}
        self._handles: dict[int, _Handle] = {}
        self._next_handle = 1
        self._reservations: dict[int, int] = {}  # address -> size
        self._mappings: dict[int, tuple[int, int]] = {}  # address -> (size, handle)
        self._granule_owner: dict[int, int] = {}  # granule address -> mapping address
        self.map_limit = _max_map_count()
        # How many of our mappings fit before the process map count must be read again.
        self._map_room = self.map_limit - MAP_COUNT_HEADROOM - _process_map_count()

    # -- reservations -----------------------------------------------------------
    def reserve(self, size: int) -> int:
        check_aligned("reserve", self.granularity, size=size)
        if size == 0:
            raise ValueError("reserve: size=0, expected a positive multiple of the granularity")
        with self._lock:
            self._check_open("reserve")
            # Over-reserve so the start can be aligned to the granularity, as the driver does.
            span = size + self.granularity
            flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE
            raw = libc.mmap(None, span, _PROT_NONE, flags, -1, 0)
            if raw in (None, _MAP_FAILED):
                raise _errno_error("reserve", None, f"size={size}")
            start = -(-raw // self.granularity) * self.granularity
            head, tail = start - raw, raw + span - (start + size)
            if head:
                libc.munmap(raw, head)
            if tail:
                libc.munmap(start + size, tail)
            self._reservations[start] = size
            return start

    def free_reservation(self, address: int, size: int) -> None:
        with self._lock:
            self._check_open("free_reservation")
            if self._reservations.get(address) != size:
                raise DriverError(
                    "free_reservation", "EINVAL", f"no reservation of size {size} here", address
                )
            if any(address <= m < address + size for m in self._mappings):
                raise DriverError(
                    "free_reservation", "EBUSY", "the range still has mappings", address
                )
            if libc.munmap(address, size) != 0:
                raise _errno_error("free_reservation", address)
            del self._reservations[address]

    # -- physical memory ----------------------------------------------------------
    def create(self, size: int) -> int:
        check_aligned("create", self.granularity, size=size)
        with self._lock:
            fd = self._check_open("create")
            free = self._free_offsets.get(size)
            offset = free.pop() if free else self._arena_size
            if offset == self._arena_size:
                try:
                    os.ftruncate(fd, self._arena_size + size)
                except OSError as e:
                    code = errno.errorcode.get(e.errno or 0, f"errno {e.errno}")
                    raise DriverError("create", code, f"size={size}: {e.strerror}") from e
                self._arena_size += size
            if libc.fallocate(fd, 0, offset, size) != 0:
                err = _errno_error("create", None, f"size={size}")
                self._free_offsets.setdefault(size, []).append(offset)
                raise err
            handle = self._next_handle
            self._next_handle += 1
            self._handles[handle] = _Handle(offset, size)
            return handle

    def release(self, handle: int) -> None:
        with self._lock:
            self._check_open("release")
            h = self._handles.get(handle)
            if h is None or h.released:
                raise DriverError("release", "EINVAL", f"unknown handle {handle!r}")
            h.released = True
            if h.mapped == 0:
                self._punch(handle, h)

    def _punch(self, handle: int, h: _Handle) -> None:
        assert self._fd is not None
        mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
        if libc.fallocate(self._fd, mode, h.offset, h.size) != 0:
            raise _errno_error("release", None, f"handle {handle}")
        del self._handles[handle]
        self._free_offsets.setdefault(h.size, []).append(h.offset)

    # -- mappings ---------------------------------------------------------------------
    def map(self, address: int, size: int, handle: int) -> None:
        check_aligned("map", self.granularity, address=address, size=size)
        with self._lock:
            fd = self._check_open("map")
            h = self._handles.get(handle)
            if h is None or h.released:
                raise DriverError("map", "EINVAL", f"unknown handle {handle!r}", address)
            if size != h.size:
                raise DriverError("map", "EINVAL", f"size {size} != handle size {h.size}", address)
            if not self._in_reservation(address, size):
                raise DriverError("map", "EINVAL", "range is not inside a reservation", address)
            granules = range(address, address + size, self.granularity)
            if any(g in self._granule_owner for g in granules):
                raise DriverError("map", "EEXIST", "range is already mapped", address)
            if 2 * (len(self._mappings) + 1) > self._map_room:
                self._check_map_count(address)
            flags = _MAP_SHARED | _MAP_FIXED
            if libc.mmap(address, size, _PROT_NONE, flags, fd, h.offset) in (None, _MAP_FAILED):
                raise _errno_error("map", address)
            self._mappings[address] = (size, handle)
            for g in granules:
                self._granule_owner[g] = address
            h.mapped += 1

    def _check_map_count(self, address: int) -> None:
        """Near the budget of maps: read the process's count; refuse within the headroom."""
        now = _process_map_count()
        free = self.map_limit - MAP_COUNT_HEADROOM - now
        if free < 2:
            raise DriverError(
                "map",
                "ENOMEM",
                f"the process has {now} memory maps, vm.max_map_count is {self.map_limit}; "
                f"{MAP_COUNT_HEADROOM} are kept for the rest of the process",
                address,
            )
        self._map_room = 2 * len(self._mappings) + free

    def set_access(self, address: int, size: int) -> None:
        check_aligned("set_access", self.granularity, address=address, size=size)
        with self._lock:
            self._check_open("set_access")
            granules = range(address, address + size, self.granularity)
            if not all(g in self._granule_owner for g in granules):
                raise DriverError("set_access", "EINVAL", "range is not fully mapped", address)
            if libc.mprotect(address, size, _PROT_RW) != 0:
                raise _errno_error("set_access", address)

    def unmap(self, address: int, size: int) -> None:
        check_aligned("unmap", self.granularity, address=address, size=size)
        with self._lock:
            self._check_open("unmap")
            self._unmap_locked(address, size)

    def _unmap_locked(self, address: int, size: int) -> None:
        owners = [
            self._granule_owner.get(g) for g in range(address, address + size, self.granularity)
        ]
        if not owners or None in owners:
            raise DriverError("unmap", "EINVAL", "range has unmapped holes", address)
        starts = list(dict.fromkeys(m for m in owners if m is not None))
        if any(m < address or m + self._mappings[m][0] > address + size for m in starts):
            raise DriverError(
                "unmap", "EINVAL", f"range of {size} bytes does not cover whole mappings", address
            )
        flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE
        if libc.mmap(address, size, _PROT_NONE, flags, -1, 0) in (None, _MAP_FAILED):
            raise _errno_error("unmap", address)
        for m in starts:
            msize, handle = self._mappings.pop(m)
            for g in range(m, m + msize, self.granularity):
                del self._granule_owner[g]
            h = self._handles[handle]
            h.mapped -= 1
            if h.released and h.mapped == 0:
                self._punch(handle, h)

    def _in_reservation(self, address: int, size: int) -> bool:
        return any(
            r <= address and address + size <= r + rs for r, rs in self._reservations.items()
        )

    # -- tensors and truth --------------------------------------------------------------
    def byte_tensor(self, address: int, size: int) -> Any:
        import torch

        buf = (ctypes.c_uint8 * size).from_address(address)
        return torch.frombuffer(buf, dtype=torch.uint8)

    def synchronize(self) -> None:
        """Host memory: every access happened when its call returned; nothing to wait for."""

    def physical_bytes(self) -> int:
        """Bytes the kernel has allocated to the arena: the host's device truth."""
        with self._lock:
            fd = self._check_open("physical_bytes")
            return os.fstat(fd).st_blocks * 512

    def is_mapped(self, address: int) -> bool:
        """Whether the granule holding `address` is mapped (read-only query for tests)."""
        granule = address - address % self.granularity
        with self._lock:
            return granule in self._granule_owner

    def stats(self) -> dict[str, int]:
        with self._lock:
            sizes = [h.size for h in self._handles.values()]
            return backend_stats(self._reservations, sizes, len(self._mappings))

    def debug_state(self) -> HostBackendState:
        """A copy of everything the backend holds (`HostBackendState`), for tests."""
        with self._lock:
            st = os.fstat(self._fd) if self._fd is not None else None
            return HostBackendState(
                reservations=dict(self._reservations),
                mappings=dict(self._mappings),
                handles={
                    h: (v.offset, v.size, v.mapped, v.released) for h, v in self._handles.items()
                },
                physical_bytes=st.st_blocks * 512 if st is not None else 0,
                memfd=(st.st_dev, st.st_ino) if st is not None else None,
            )

    # -- lifetime ---------------------------------------------------------------------------
    def _check_open(self, op: str) -> int:
        if self._fd is None:
            raise ClosedError(f"{op}: the host backend is closed")
        return self._fd

    @property
    def closed(self) -> bool:
        return self._fd is None

    def close(self) -> None:
        """Unmap everything, free every reservation and close the memfd. Idempotent."""
        with self._lock:
            if self._fd is None:
                return
            for address, size in list(self._reservations.items()):
                libc.munmap(address, size)
            self._reservations.clear()
            self._mappings.clear()
            self._granule_owner.clear()
            self._handles.clear()
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> HostBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
