"""Reading page ids SGLang computed on its device, without a device synchronisation.

On CPU the ids are host memory already: `HostReader` views them. On CUDA the ids a free
releases are device tensors; reading one with `.tolist()` would wait for the whole stream.
`CudaReader` instead copies them into pinned host memory with `non_blocking=True` and
records a CUDA event after the copy: the values are read when the event has completed
(`PendingIds.ids`), normally long before they are needed, since the scheduler does host
work between a free and the next allocation. When they are needed sooner, the read waits
on that event (only for the copy and the small kernels before it: SGLang's free path has
synchronised already, on `torch.unique` or its boolean mask) and `waits` counts it.

The pages released carry a *fence* (`DeviceFence`): reading an unmapped page faults and
poisons the context (docs/background.md#cuda-driver-facts), and a kernel that reads them
may still be queued, on the scheduler's stream or another one (the overlap scheduler runs
the forward on its own stream). An event on one stream cannot say that work on every other
stream is done, so the fence is not done until it has been waited for, and waiting is a
device synchronisation. Only the page store's background mapper waits (off the scheduler's
thread, just before it unmaps fenced spares); the scheduler's step never does. On the host
no fence is needed.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class PendingIds:
    """Ids being copied to the host; `event` (None: already there) says when they are."""

    __slots__ = ("_host", "event", "reader")

    def __init__(self, host: Any, event: Any, reader: Any) -> None:
        self._host = host
        self.event = event
        self.reader = reader

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def ids(self) -> np.ndarray:
        if self.event is not None and not self.event.query():
            self.reader.waits += 1
            self.event.synchronize()
        out: np.ndarray = self._host.numpy() if hasattr(self._host, "numpy") else self._host
        return out

    # -- as a fence (allocator.store.Fence) --------------------------------------------------
    def done(self) -> bool:
        return self.ready()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def __len__(self) -> int:
        return int(self._host.shape[0])


class DeviceFence:
    """Done once the whole device has drained past the point it was made (a
    `torch.cuda.synchronize` from the thread that waits); `done()` never synchronises."""

    __slots__ = ("_device", "_done", "_torch")

    def __init__(self, torch: Any, device: Any) -> None:
        self._torch = torch
        self._device = device
        self._done = False

    def done(self) -> bool:
        return self._done

    def wait(self) -> None:
        if not self._done:
            self._torch.cuda.synchronize(self._device)
            self._done = True


class HostReader:
    """CPU tensors: the ids are there; no fence."""

    waits = 0
    device = "cpu"

    def read_many(self, tensors: list[Any]) -> tuple[PendingIds, list[int]]:
        """Every tensor's ids in one host array (a view when there is one tensor), with each
        one's length."""
        flat = [t.reshape(-1) for t in tensors]
        sizes = [int(f.shape[0]) for f in flat]
        one = flat[0] if len(flat) == 1 else _torch().cat(flat)
        return PendingIds(one.numpy(), None, self), sizes

    def fence_now(self) -> Any:
        return None


class CudaReader:
    """CUDA tensors: a pinned, non-blocking copy and an event per read."""

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self.device = device
        self.waits = 0  # reads that had to wait for their copy

    def read_many(self, tensors: list[Any]) -> tuple[PendingIds, list[int]]:
        """Every tensor's ids: one concatenation on the device, one pinned non-blocking copy
        and one event, whatever the number of tensors."""
        torch = self._torch
        flat = [t.reshape(-1) for t in tensors]
        sizes = [int(f.shape[0]) for f in flat]
        one = flat[0] if len(flat) == 1 else torch.cat(flat)
        host = torch.empty(one.shape, dtype=one.dtype, pin_memory=True)
        host.copy_(one, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(one.device))
        return PendingIds(host, event, self), sizes

    def fence_now(self) -> Any:
        """A fence that is done once every kernel queued so far, on any stream, has run."""
        return DeviceFence(self._torch, self.device)


def _torch() -> Any:
    import torch

    return torch


def reader_for(device: str) -> Any:
    if device.startswith("cuda"):
        return CudaReader(device)
    return HostReader()
