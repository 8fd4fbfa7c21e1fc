"""A device's queue on the host: `QueuedDevice` wraps a backend and keeps *queued work*, byte
ranges that device work not yet run will access (a kernel, a copy queued on a stream), as
the CUDA driver would see them. `synchronize()` runs it all; an `unmap` that meets a range
still queued is what faults the context on a GPU, and is recorded in `faults` (the call then
goes ahead, as the driver's does). `LateFence` is a fence whose work is done only once it
has been waited for (a device fence), recording when, in the same `log` as the backend's
unmaps."""

from __future__ import annotations

from typing import Any


class QueuedDevice:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = f"queued-{inner.name}"
        self.granularity = inner.granularity
        self.queued: list[tuple[int, int]] = []  # (address, size) of work not run yet
        self.faults: list[str] = []
        self.log: list[str] = []
        self.syncs = 0

    def queue(self, address: int, size: int) -> None:
        """Device work that will access [address, address + size) is queued now."""
        self.queued.append((address, size))

    def synchronize(self) -> None:
        self.syncs += 1
        self.log.append("synchronize")
        self.queued.clear()

    def unmap(self, address: int, size: int) -> None:
        for a, n in self.queued:
            if a < address + size and address < a + n:
                self.faults.append(f"unmap of [{address:#x}, +{size}) with work queued on it")
                break
        self.log.append(f"unmap {address:#x}")
        self.inner.unmap(address, size)

    def __getattr__(self, name: str) -> Any:  # reserve, create, map, ... go straight through
        return getattr(self.inner, name)


class LateFence:
    """Not done until waited for; the wait is logged in `log`."""

    def __init__(self, log: list[str], name: str = "fence") -> None:
        self.log = log
        self.name = name
        self.waited = False

    def done(self) -> bool:
        return self.waited

    def wait(self) -> None:
        if not self.waited:
            self.log.append(f"wait {self.name}")
        self.waited = True
