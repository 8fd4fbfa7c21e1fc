"""Host-only parts of the backend contract: the reserved range really faults, physical memory
is really the memfd's blocks, and close() leaves no fd, mapping or block behind."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from allocator.errors import DriverError
from allocator.host import HostBackend
from tests.allocator.rigs import SMALL_GRANULARITY

ROOT = Path(__file__).resolve().parents[2]


def _touch_in_subprocess(setup: str) -> subprocess.CompletedProcess[str]:
    """Run `setup` (which binds `addr`) in a fresh interpreter, then write one byte at `addr`."""
    code = textwrap.dedent(
        """
        import ctypes
        from allocator.host import HostBackend
        be = HostBackend({g})
        g = be.granularity
        {setup}
        ctypes.c_uint8.from_address(addr).value = 7
        assert ctypes.c_uint8.from_address(addr).value == 7
        print("touched", flush=True)
        """
    ).format(g=SMALL_GRANULARITY, setup=setup)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": ""}
    env.pop("PYTHONFAULTHANDLER")
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )


FAULTING = {
    "reserved, never mapped": "base = be.reserve(2 * g); addr = base + g + 100",
    "mapped without set_access": (
        "base = be.reserve(g); h = be.create(g); be.map(base, g, h); addr = base + 5"
    ),
    "mapped, accessed, then unmapped": (
        "base = be.reserve(g); h = be.create(g); be.map(base, g, h); be.set_access(base, g);"
        " ctypes.c_uint8.from_address(base).value = 1; be.unmap(base, g); addr = base"
    ),
}


@pytest.mark.parametrize("case", list(FAULTING))
def test_touching_an_inaccessible_range_dies_with_sigsegv(case: str) -> None:
    proc = _touch_in_subprocess(FAULTING[case])
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stdout, proc.stderr)
    assert "touched" not in proc.stdout


def test_touching_a_mapped_accessible_range_works_in_the_same_harness() -> None:
    proc = _touch_in_subprocess(
        "base = be.reserve(g); h = be.create(g); be.map(base, g, h); be.set_access(base, g);"
        " addr = base + g - 1"
    )
    assert proc.returncode == 0, proc.stderr
    assert "touched" in proc.stdout


def test_granularity_must_be_a_multiple_of_the_os_page() -> None:
    with pytest.raises(ValueError, match="granularity=1000"):
        HostBackend(1000)


def test_physical_bytes_are_the_memfd_blocks_of_live_handles(host: HostBackend) -> None:
    g = host.granularity
    assert host.physical_bytes() == 0
    handles = [host.create(g) for _ in range(3)] + [host.create(4 * g)]
    assert host.physical_bytes() == 7 * g  # committed at create, like cuMemCreate
    base = host.reserve(4 * g)
    host.map(base, 4 * g, handles[3])
    host.set_access(base, 4 * g)
    host.byte_tensor(base, 4 * g).fill_(1)
    assert host.physical_bytes() == 7 * g  # mapping and touching commit nothing more
    host.release(handles[0])
    assert host.physical_bytes() == 6 * g  # release drops the blocks
    host.release(handles[3])
    assert host.physical_bytes() == 6 * g  # still mapped: deferred
    host.unmap(base, 4 * g)
    assert host.physical_bytes() == 2 * g  # the unmap completed the release
    h = host.create(g)  # reuses a punched range
    assert host.physical_bytes() == 3 * g
    for x in (handles[1], handles[2], h):
        host.release(x)
    assert host.physical_bytes() == 0
    host.free_reservation(base, 4 * g)


def test_a_reused_handle_range_starts_zeroed(host: HostBackend) -> None:
    g = host.granularity
    base = host.reserve(g)
    h = host.create(g)
    host.map(base, g, h)
    host.set_access(base, g)
    host.byte_tensor(base, g).fill_(0xFF)
    host.unmap(base, g)
    host.release(h)
    h2 = host.create(g)
    host.map(base, g, h2)
    host.set_access(base, g)
    assert int(host.byte_tensor(base, g).sum()) == 0
    host.unmap(base, g)
    host.release(h2)
    host.free_reservation(base, g)


def test_unmap_must_cover_whole_mappings(host: HostBackend) -> None:
    """A range that cuts through a mapping is refused and changes nothing."""
    g = host.granularity
    base = host.reserve(4 * g)
    h2, h1 = host.create(2 * g), host.create(g)
    host.map(base, 2 * g, h2)  # granules 0-1
    host.map(base + 2 * g, g, h1)  # granule 2
    for address, size in ((base + g, g), (base + g, 2 * g), (base, g)):
        with pytest.raises(DriverError) as info:
            host.unmap(address, size)
        assert info.value.address == address
    assert host.stats()["mappings"] == 2
    host.set_access(base, 3 * g)
    host.byte_tensor(base, 3 * g).fill_(9)  # every granule is still mapped
    host.unmap(base, 3 * g)  # covering both whole mappings at once is fine
    assert host.stats()["mappings"] == 0
    host.release(h1)
    host.release(h2)
    host.free_reservation(base, 4 * g)


def test_map_outside_a_reservation_or_with_a_wrong_size_is_refused(host: HostBackend) -> None:
    g = host.granularity
    base = host.reserve(g)
    h = host.create(g)
    with pytest.raises(DriverError, match="inside a reservation"):
        host.map(base + g, g, h)
    with pytest.raises(DriverError, match="handle size"):
        host.map(base, 2 * g, h)
    host.release(h)
    with pytest.raises(DriverError, match="unknown handle"):
        host.map(base, g, h)
    host.free_reservation(base, g)


def _memfd_fds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "kvledger-physical" in target:
            out.append(target)
    return out


def _maps_lines(inode: int | None = None) -> list[tuple[int, int, str]]:
    """(start, end, name) of /proc/self/maps, only those of file `inode` when given (other tests
    in this process may hold backends of their own)."""
    rows = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if inode is not None and int(parts[4]) != inode:
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        rows.append((lo, hi, parts[5] if len(parts) > 5 else ""))
    return rows


def test_close_leaves_no_memfd_no_mapping_and_no_reservation() -> None:
    before = len(_memfd_fds())
    be = HostBackend(SMALL_GRANULARITY)
    g = be.granularity
    assert len(_memfd_fds()) == before + 1
    base = be.reserve(8 * g)
    spare = be.reserve(g)
    for i in range(4):
        h = be.create(g)
        be.map(base + i * g, g, h)
        be.set_access(base + i * g, g)
        be.byte_tensor(base + i * g, g).fill_(i)
    be.create(g)  # an unmapped live handle
    memfd = be.debug_state().memfd
    assert memfd is not None
    inode = memfd[1]
    assert any("kvledger-physical" in name for _, _, name in _maps_lines(inode))
    be.close()
    assert len(_memfd_fds()) == before
    ranges = [(base, base + 8 * g), (spare, spare + g)]
    for lo, hi, name in _maps_lines(inode):
        assert "kvledger-physical" not in name, f"memfd still mapped: {lo:x}-{hi:x} {name}"
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        if perms != "---p":  # a reservation's signature; anything else may reuse the range
            continue
        lo, hi = (int(x, 16) for x in span.split("-"))
        for rlo, rhi in ranges:
            assert hi <= rlo or lo >= rhi, f"{lo:x}-{hi:x} overlaps a freed reservation"
    assert be.stats() == {
        "reservations": 0,
        "reserved_bytes": 0,
        "handles": 0,
        "handle_bytes": 0,
        "mappings": 0,
    }


class _NoSpaceLibc:
    """Stands in for libc: fallocate fails with ENOSPC, everything else is the real call."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def fallocate(self, fd: int, mode: int, offset: int, size: int) -> int:
        if mode == 0:
            ctypes.set_errno(errno.ENOSPC)
            return -1
        return int(self._real.fallocate(fd, mode, offset, size))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def test_create_out_of_memory_is_a_driver_error_and_holds_nothing(
    host: HostBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    import allocator.host as host_module

    g = host.granularity
    kept = host.create(g)

    def no_room(fd: int, length: int) -> None:
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(os, "ftruncate", no_room)  # growing the arena fails
    with pytest.raises(DriverError) as info:
        host.create(g)
    assert info.value.op == "create" and info.value.error_name == "EFBIG"
    monkeypatch.undo()
    monkeypatch.setattr(host_module, "libc", _NoSpaceLibc(host_module.libc))
    with pytest.raises(DriverError) as info:  # committing the blocks fails
        host.create(g)
    assert info.value.op == "create" and info.value.error_name == "ENOSPC"
    monkeypatch.undo()
    assert host.stats()["handles"] == 1 and host.physical_bytes() == g
    h = host.create(g)  # works again, and its blocks are really there
    assert host.physical_bytes() == 2 * g
    host.release(h)
    host.release(kept)
    assert host.physical_bytes() == 0
