"""The serving loop's forward stand-ins (`kvledger bench sglang --part serving`): a forward
stream the scheduler launches forwards on and waits for, in launch order.

On CUDA (`CudaDevice`) `torch.cuda._sleep` calibrated to F ms on a stream of its own and the
scheduler on another (SGLang's `schedule_stream`), with SGLang's coarse WAR barrier after
each launch (`schedule_stream.wait_stream(forward_stream)`): everything the scheduler queues
afterwards is behind that forward. On the host backend (`--device cpu`, `HostDevice`) a
worker thread that sleeps F ms per queued forward, releasing the GIL, as a GPU forward leaves
the CPU to the scheduler (`sglang_waits.ModelReader` gives the bridge's reads and fences
CUDA's order behind it).

Both count forwards from 1 in launch order: `launch(seconds)` returns the forward's number,
`done(n)` says whether forward `n` has run, `wait(n)` blocks until it has.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from typing import Any


class HostDevice:
    """A forward stream on the host: each launched forward runs `seconds` on a worker thread
    (a sleep: the GIL released, as a GPU forward leaves the CPU to the scheduler), in launch
    order. `done(n)`: forward `n` (1-based, in launch order) has run. A forward launched with
    `seconds=None` runs until `release()` (or until a wait for it releases it: the proof's
    forward, as long as the path it overlaps)."""

    def __init__(self) -> None:
        self._gate = threading.Event()
        self.launched = 0
        self._done = 0
        self._cond = threading.Condition()
        self._queue: queue.SimpleQueue[tuple[int, float | None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvledger-forward", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            n, seconds = item
            if seconds is None:
                self._gate.wait()
                self._gate.clear()
            elif seconds > 0:
                time.sleep(seconds)
            with self._cond:
                self._done = n
                self._cond.notify_all()

    def launch(self, seconds: float | None) -> int:
        self.launched += 1
        self._queue.put((self.launched, seconds))
        return self.launched

    def release(self) -> None:
        """End a forward launched with `seconds=None`."""
        self._gate.set()

    def done(self, n: int) -> bool:
        return self._done >= n

    def wait(self, n: int) -> None:
        self.release()
        with self._cond:
            while self._done < n:
                self._cond.wait()

    def close(self) -> None:
        self.release()
        self._queue.put(None)
        self._thread.join(timeout=5)


class CudaDevice:
    """A forward stream and a schedule stream on CUDA; forwards are `torch.cuda._sleep`
    calibrated to the seconds asked. `sched` is the stream the scheduler's work runs on."""

    def __init__(self, device: str) -> None:
        import torch

        self._torch = torch
        self.forward = torch.cuda.Stream(device)
        self.sched = torch.cuda.Stream(device)
        self.launched = 0
        self._events: dict[int, Any] = {}
        self.cycles_per_s = self._calibrate()

    def _calibrate(self) -> float:
        torch = self._torch
        torch.cuda._sleep(1000)  # warm
        torch.cuda.synchronize()
        cycles = 20_000_000
        best = math.inf
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(cycles)
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) / 1000)
        return cycles / best

    def launch(self, seconds: float) -> int:
        torch = self._torch
        self.forward.wait_stream(self.sched)
        with torch.cuda.stream(self.forward):
            if seconds > 0:
                torch.cuda._sleep(int(seconds * self.cycles_per_s))
            ev = torch.cuda.Event()
            ev.record(self.forward)
        self.sched.wait_stream(self.forward)  # SGLang's coarse WAR barrier
        self.launched += 1
        self._events[self.launched] = ev
        return self.launched

    def done(self, n: int) -> bool:
        ev = self._events.get(n)
        return ev is None or bool(ev.query())

    def wait(self, n: int) -> None:
        ev = self._events.pop(n, None)
        if ev is not None:
            ev.synchronize()

    def close(self) -> None:
        self._torch.cuda.synchronize()
