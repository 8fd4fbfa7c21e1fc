"""Host VMM backend: the CUDA VMM semantics over Linux memfd + mmap.

- A reservation is an anonymous PROT_NONE, MAP_NORESERVE mapping: address
  space only, and touching it faults (SIGSEGV), as an unmapped CUDA VA does.
- Physical memory is one memfd per backend (the "arena"). `create` fallocates a
  range of it, so the blocks are committed at once, like cuMemCreate; the
  handle is that range. `release` (deferred while the handle is still mapped)
  hands the range to the backend's *reaper* thread, which punches it out, and
  the memfd's allocated blocks drop. Punching a range frees its pages in the
  kernel (about 0.1 ms per 2 MiB here), work the allocating thread need not
  wait for; the call releases the GIL, so the reaper runs beside it. A range
  goes back to the arena's free ranges only once punched, so a `create` never
  gets a range still being freed (it extends the arena instead) and always
  reads zeros.
- `map` places the memfd range over the reservation with MAP_FIXED but
  PROT_NONE; `set_access` makes it readable and writable; `unmap` puts the
  inaccessible reservation back.

`physical_bytes()` reads the truth from the kernel: `fstat(memfd).st_blocks * 512`,
after waiting for the reaper to finish every punch queued before the call. So a handle
released is gone from the truth whenever the truth is read, exactly as the books
(`stats()`, and a ledger counting the release) say: the two agree at every reading.
A punch that fails is counted (`reap_failures`) and logged; its blocks stay allocated
(the truth shows them, so a reconciliation sees the difference) and its range is never
reused; `close()` frees them with the memfd. `HostBackend(reaper=False)` punches on the
releasing thread, as before the reaper, raising DriverError when the punch fails.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from collections import deque
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

log = logging.getLogger(__name__)

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

    def __init__(self, granularity: int = DEFAULT_GRANULARITY, *, reaper: bool = True) -> None:
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
        # Released ranges waiting for the reaper, (offset, size); `_reaping` counts the one
        # being punched; `_reaped` is notified (under `_lock`) when a punch ends.
        self.reaper = reaper
        self._reap_queue: deque[tuple[int, int]] = deque()
        self._reaping = 0
        self._reaping_bytes = 0
        self._reaped = threading.Condition(self._lock)
        self._reaper_thread: threading.Thread | None = None
        self._stopping = False
        self.reaped = 0  # ranges punched by the reaper
        self.reap_failures = 0  # punches that failed (their blocks stay allocated)
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
                self._retire(handle, h)

    def _retire(self, handle: int, h: _Handle) -> None:
        """The handle is released and unmapped: its range goes to the reaper (or is punched
        now, without one). Lock held."""
        if not self.reaper:
            self._punch(handle, h)
            return
        del self._handles[handle]
        self._reap_queue.append((h.offset, h.size))
        self._start_reaper()
        self._reaped.notify_all()

    def _punch(self, handle: int, h: _Handle) -> None:
        assert self._fd is not None
        mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
        if libc.fallocate(self._fd, mode, h.offset, h.size) != 0:
            raise _errno_error("release", None, f"handle {handle}")
        del self._handles[handle]
        self._free_offsets.setdefault(h.size, []).append(h.offset)

    # -- the reaper ---------------------------------------------------------------------
    def _start_reaper(self) -> None:
        """Start the reaper thread if it is not running (first release; after a fork). Lock
        held."""
        t = self._reaper_thread
        if t is None or not t.is_alive():
            t = threading.Thread(target=self._reap, name="kvledger-host-reaper", daemon=True)
            self._reaper_thread = t
            t.start()

    def _reap(self) -> None:
        """The reaper's loop: punch each queued range, the lock released during the call;
        then the range is free for `create`. Ends at `close()` (what is still queued goes
        with the memfd)."""
        mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
        with self._lock:
            while True:
                while not self._reap_queue and not self._stopping:
                    self._reaped.wait()
                if self._stopping or self._fd is None:
                    return
                offset, size = self._reap_queue.popleft()
                fd = self._fd  # stays open: close() joins this thread before closing it
                self._reaping += 1
                self._reaping_bytes += size
                self._lock.release()
                try:
                    rc = libc.fallocate(fd, mode, offset, size)
                    err = ctypes.get_errno() if rc != 0 else 0
                except BaseException as e:  # a stand-in libc raising: counted, never fatal
                    rc, err = -1, getattr(e, "errno", None) or errno.EIO
                finally:
                    self._lock.acquire()
                self._reaping -= 1
                self._reaping_bytes -= size
                if rc == 0:
                    self.reaped += 1
                    self._free_offsets.setdefault(size, []).append(offset)
                else:
                    self.reap_failures += 1
                    log.error(
                        "kvledger host backend: punching %d bytes at arena offset %d failed "
                        "(%s); the blocks stay allocated until close",
                        size,
                        offset,
                        errno.errorcode.get(err, f"errno {err}"),
                    )
                self._reaped.notify_all()

    def _wait_reaped(self) -> None:
        """Wait until every range queued so far is punched (or failed). Lock held."""
        while self._reap_queue or self._reaping:
            if not self._reaping:
                self._start_reaper()  # none running (a fork): start one
            self._reaped.wait(timeout=1.0)

    def wait_released(self) -> None:
        """Return once every range released before the call is punched (or failed): what a
        reader of the kernel's own figures (/proc, fstat) needs first. Takes the lock."""
        with self._lock:
            self._wait_reaped()

    def pending_release_bytes(self) -> int:
        """Bytes released and not punched yet (queued or being punched); takes the lock."""
        with self._lock:
            return self._reaping_bytes + sum(size for _, size in self._reap_queue)

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
                self._retire(handle, h)

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
        """Bytes the kernel has allocated to the arena: the host's device truth, read once
        every release made before the call has been punched (see the module docstring)."""
        with self._lock:
            fd = self._check_open("physical_bytes")
            self._wait_reaped()
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
            if self._fd is not None:
                self._wait_reaped()
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
        """Stop the reaper, unmap everything, free every reservation and close the memfd
        (which frees every block, punched or not). Idempotent."""
        with self._lock:
            if self._fd is None:
                return
            self._stopping = True
            self._reaped.notify_all()
            reaper = self._reaper_thread
        if reaper is not None and reaper is not threading.current_thread():
            reaper.join()  # it ends after the punch under way, if any: the fd is still open
        with self._lock:
            if self._fd is None:
                return
            self._reap_queue.clear()
            self._reaper_thread = None
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
