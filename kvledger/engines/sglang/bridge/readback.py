"""Reading page ids SGLang computed on its device, without a device synchronisation.

The journal (journal.py) reads page-id tensors in batches (`read_many`: many tensors, one read).
On CPU the ids are host memory already: `HostReader` reads their values at once. On CUDA
they are device tensors; reading one with `.tolist()` would wait for the whole stream.
`CudaReader` instead concatenates them on the device and copies the result into pinned
host memory (a buffer it keeps and reuses) with `non_blocking=True`, recording a CUDA event
after the copy: the values are
read when the event has completed (`CudaRead.lists`), normally long before they are needed,
since the scheduler does host work between two replays. When they are needed sooner, the
read waits on that event (only for the copy and the small kernels before it) and `waits`
counts it.

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


class HostRead:
    """CPU tensors: their values, read at once (through numpy: a torch slice costs several
    times a numpy one)."""

    __slots__ = ("_lists",)

    def __init__(self, items: list[tuple[Any, int | None]]) -> None:
        out = []
        for t, n in items:
            a = t.numpy()
            if a.ndim != 1:
                a = a.reshape(-1)
            out.append((a[:n] if n is not None else a).tolist())
        self._lists = out

    def ready(self) -> bool:
        return True

    def lists(self) -> list[list[int]]:
        return self._lists


class CudaRead:
    """Device tensors being copied to pinned host memory; `event` says when they are there."""

    __slots__ = ("_buffer", "_host", "_lists", "_sizes", "event", "reader")

    def __init__(self, buffer: Any, host: Any, sizes: list[int], event: Any, reader: Any) -> None:
        self._buffer = buffer  # the reader's pinned buffer `host` is a view of
        self._host = host
        self._sizes = sizes
        self.event = event
        self.reader = reader
        self._lists: list[list[int]] | None = None

    def ready(self) -> bool:
        return self._lists is not None or bool(self.event.query())

    def lists(self) -> list[list[int]]:
        """Each tensor's values; waits for the copy (counted in the reader's `waits`) when
        it has not landed yet. The pinned buffer goes back to the reader once read."""
        if self._lists is None:
            if not self.event.query():
                self.reader.waits += 1
                self.event.synchronize()
            flat = self._host.tolist()
            out, k = [], 0
            for n in self._sizes:
                out.append(flat[k : k + n])
                k += n
            self._lists = out
            self._host = None
            self.reader.give_back(self._buffer, self.event)
            self._buffer = None
        return self._lists


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


class StreamFence:
    """Done once the work queued on the current stream so far has run: a CUDA event. Enough
    only where no other stream can be using the pages (compaction, between batches)."""

    __slots__ = ("_event",)

    def __init__(self, event: Any) -> None:
        self._event = event

    def done(self) -> bool:
        return bool(self._event.query())

    def wait(self) -> None:
        self._event.synchronize()


class HostReader:
    """CPU tensors: the ids are there; no fence."""

    waits = 0
    device = "cpu"

    def read_many(self, items: list[tuple[Any, int | None]]) -> HostRead:
        """The values of each (tensor, n): its first `n` (all with None)."""
        return HostRead(items)

    def fence_now(self) -> Any:
        return None

    def stream_fence(self) -> Any:
        return None


class CudaReader:
    """CUDA tensors: a non-blocking copy into pinned host memory and an event per read.

    The pinned buffers and events are kept and reused (a buffer goes back once its read has
    been read, so its copy is done and its values copied out): allocating pinned memory and
    an event for every read cost about as much as the read itself
    (`docs/benchmarks-history.md`)."""

    KEEP = 8  # pinned buffers kept for reuse at most
    LEAST = 1024  # values a new buffer holds at least

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self.device = device
        self.waits = 0  # reads that had to wait for their copy
        self._free: list[Any] = []  # pinned buffers whose read has been read
        self._events: list[Any] = []  # events whose read has been read

    def read_many(self, items: list[tuple[Any, int | None]]) -> CudaRead:
        """The values of each (tensor, n): its first `n` (all with None). One copy to the
        host and one event, whatever the number of tensors (several are concatenated on the
        device first)."""
        torch = self._torch
        flat = []
        for t, n in items:
            if t.dim() != 1:
                t = t.reshape(-1)
            flat.append(t[:n] if n is not None else t)
        sizes = [int(f.shape[0]) for f in flat]
        one = flat[0] if len(flat) == 1 else torch.cat(flat)
        total = sum(sizes)
        buffer = self._buffer(total, one.dtype)
        host = buffer[:total]
        host.copy_(one, non_blocking=True)
        event = self._events.pop() if self._events else torch.cuda.Event()
        event.record(torch.cuda.current_stream(one.device))
        return CudaRead(buffer, host, sizes, event, self)

    def _buffer(self, n: int, dtype: Any) -> Any:
        free = self._free
        for i in range(len(free) - 1, -1, -1):
            b = free[i]
            if b.dtype == dtype and b.shape[0] >= n:
                return free.pop(i)
        size = max(self.LEAST, 1 << max(0, n - 1).bit_length())
        return self._torch.empty(size, dtype=dtype, pin_memory=True)

    def give_back(self, buffer: Any, event: Any) -> None:
        """A read's buffer and event, its values read (so its copy has landed): reused."""
        if len(self._free) < self.KEEP:
            self._free.append(buffer)
        if len(self._events) < self.KEEP:
            self._events.append(event)

    def fence_now(self) -> Any:
        """A fence that is done once every kernel queued so far, on any stream, has run."""
        return DeviceFence(self._torch, self.device)

    def stream_fence(self) -> StreamFence:
        """A fence that is done once the work queued so far on the current stream has run."""
        event = self._torch.cuda.Event()
        event.record(self._torch.cuda.current_stream(self.device))
        return StreamFence(event)


def reader_for(device: str) -> Any:
    if device.startswith("cuda"):
        return CudaReader(device)
    return HostReader()


def host_ids(t: Any) -> Any:
    """A whole device or host tensor of ids read to the host as numpy (attach, `clear` and
    resyncs only: on CUDA this synchronises)."""
    import numpy as np

    return np.asarray(t.detach().to("cpu").reshape(-1).numpy(), dtype=np.int64)
