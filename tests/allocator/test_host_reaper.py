"""The host backend's reaper: released memfd blocks are punched off the releasing thread, and
the truth (`physical_bytes()`) still agrees with the books at every reading."""

from __future__ import annotations

import ctypes
import errno
import os
import random
import threading
from typing import Any

import pytest

import allocator.host as host_module
from allocator.host import HostBackend
from tests.allocator.rigs import SMALL_GRANULARITY

_PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


class _SlowPunchLibc:
    """Stands in for libc: a punch waits for `go` and records the thread that made it (or
    fails with EIO when `fail`); every other call is the real one."""

    def __init__(self, real: Any, *, fail: bool = False) -> None:
        self._real = real
        self.go = threading.Event()
        self.started = threading.Event()
        self.threads: list[int] = []
        self.fail = fail

    def fallocate(self, fd: int, mode: int, offset: int, size: int) -> int:
        if mode == _PUNCH:
            self.threads.append(threading.get_ident())
            self.started.set()
            assert self.go.wait(30), "the test never let the punch go"
            if self.fail:
                ctypes.set_errno(errno.EIO)
                return -1
        return int(self._real.fallocate(fd, mode, offset, size))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _memfds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "kvledger-physical" in os.readlink(f"/proc/self/fd/{fd}"):
                out.append(fd)
        except OSError:
            continue
    return out


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch) -> _SlowPunchLibc:
    fake = _SlowPunchLibc(host_module.libc)
    monkeypatch.setattr(host_module, "libc", fake)
    return fake


def test_release_returns_before_the_blocks_are_punched_and_the_truth_waits_for_them(
    slow: _SlowPunchLibc,
) -> None:
    with HostBackend(SMALL_GRANULARITY) as be:
        g = be.granularity
        h = be.create(g)
        done = threading.Event()

        def release() -> None:
            be.release(h)
            done.set()

        releaser = threading.Thread(target=release)
        releaser.start()
        # The punch is held back, yet release has returned: it did not wait for the kernel.
        assert done.wait(5), "release waited for the punch"
        assert slow.started.wait(5)
        assert be.stats()["handles"] == 0 and be.pending_release_bytes() == g
        got: list[int] = []
        reader = threading.Thread(target=lambda: got.append(be.physical_bytes()))
        reader.start()
        reader.join(0.3)
        assert reader.is_alive() and not got  # the truth is not read mid-release...
        slow.go.set()
        reader.join(10)
        assert got == [0]  # ...but once the blocks are gone: books and truth agree
        assert be.pending_release_bytes() == 0 and be.reaped == 1
        releaser.join()
        assert slow.threads and threading.get_ident() not in slow.threads
        assert releaser.ident not in slow.threads  # punched on the reaper's thread


def test_a_range_being_punched_is_not_handed_out_again(slow: _SlowPunchLibc) -> None:
    with HostBackend(SMALL_GRANULARITY) as be:
        g = be.granularity
        base = be.reserve(g)
        h = be.create(g)
        be.map(base, g, h)
        be.set_access(base, g)
        be.byte_tensor(base, g).fill_(0xFF)
        be.unmap(base, g)
        old = be.debug_state().handles[h][0]  # its arena offset
        be.release(h)
        assert slow.started.wait(5)
        h2 = be.create(g)  # the released range is still being punched: a fresh one
        assert be._handles[h2].offset != old
        be.map(base, g, h2)
        be.set_access(base, g)
        assert int(be.byte_tensor(base, g).sum()) == 0  # zeros, not the old range's 0xFF
        slow.go.set()
        be.unmap(base, g)
        be.release(h2)
        assert be.physical_bytes() == 0
        be.free_reservation(base, g)


def test_close_with_punches_pending_stops_the_reaper_and_leaves_no_memfd(
    slow: _SlowPunchLibc,
) -> None:
    before = len(_memfds())
    be = HostBackend(SMALL_GRANULARITY)
    g = be.granularity
    handles = [be.create(g) for _ in range(4)]
    for h in handles:
        be.release(h)
    assert slow.started.wait(5)
    reaper = be._reaper_thread
    assert reaper is not None and reaper.is_alive()
    closer = threading.Thread(target=be.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()  # close waits for the punch under way (the fd is in use)...
    slow.go.set()
    closer.join(10)
    assert not closer.is_alive() and not reaper.is_alive()
    assert len(_memfds()) == before  # ...then closes the memfd: every block is gone
    be.close()  # idempotent


def test_a_failed_punch_is_counted_and_the_truth_keeps_the_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _SlowPunchLibc(host_module.libc, fail=True)
    fake.go.set()
    monkeypatch.setattr(host_module, "libc", fake)
    with HostBackend(SMALL_GRANULARITY) as be:
        g = be.granularity
        keep = be.create(g)
        be.release(be.create(g))  # never raises on the releasing thread
        assert be.physical_bytes() == 2 * g  # the truth shows what the kernel still holds
        assert be.reap_failures == 1 and be.reaped == 0
        monkeypatch.undo()
        h = be.create(g)  # the failed range is not reused: the arena grows
        assert be.physical_bytes() == 3 * g
        be.release(h)
        be.release(keep)
        assert be.physical_bytes() == g  # only the failed range is left, until close


def test_reaper_false_punches_on_the_releasing_thread(slow: _SlowPunchLibc) -> None:
    slow.go.set()
    with HostBackend(SMALL_GRANULARITY, reaper=False) as be:
        be.release(be.create(be.granularity))
        assert slow.threads == [threading.get_ident()]
        assert be._reaper_thread is None and be.physical_bytes() == 0


def test_many_releases_keep_books_and_truth_equal_at_every_reading() -> None:
    rng = random.Random(5)
    with HostBackend(SMALL_GRANULARITY) as be:
        g = be.granularity
        base = be.reserve(8 * g)
        live: dict[int, int] = {}  # handle -> size
        mapped: dict[int, tuple[int, int]] = {}  # slot -> (handle, size)
        for _ in range(300):
            op = rng.random()
            if op < 0.4 or not live:
                h = be.create(g)
                live[h] = g
                slot = rng.randrange(8)
                if slot not in mapped:
                    be.map(base + slot * g, g, h)
                    mapped[slot] = (h, g)
            elif op < 0.8:
                h = rng.choice(list(live))
                be.release(h)
                del live[h]
            elif mapped:
                slot = rng.choice(list(mapped))
                be.unmap(base + slot * g, g)
                del mapped[slot]
            # released handles still mapped hold their blocks until their unmap
            held = set(live) | {h for h, _ in mapped.values()}
            assert be.physical_bytes() == len(held) * g
        for slot in list(mapped):
            be.unmap(base + slot * g, g)
        for h in list(live):
            be.release(h)
        assert be.physical_bytes() == 0 and be.reap_failures == 0
        be.free_reservation(base, 8 * g)
