"""The scheduler thread's waits: the host device model's ordering of the bridge's reads and
fences (`kvledger.tools.bench.sglang_waits.ModelReader` over `sglang_forward.HostDevice`) and
the swap of torch's synchronize methods."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from kvledger.tools.bench.sglang_forward import HostDevice
from kvledger.tools.bench.sglang_waits import ModelReader, WaitLog, synchronize_wrapped


def test_the_host_device_orders_reads_and_fences_behind_the_forwards_launched() -> None:
    dev = HostDevice()
    log = WaitLog()
    log.owner = threading.get_ident()
    reader = ModelReader(dev, log)
    try:
        import torch

        first = reader.read_many([(torch.tensor([1, 2]), None)])
        assert first.ready()  # nothing launched before it
        assert first.lists() == [[1, 2]] and log.waits == 0
        n = dev.launch(0.05)
        read = reader.read_many([(torch.tensor([3]), None)])
        fence = reader.fence_now()
        assert not read.ready() and not fence.done()
        t0 = time.perf_counter()
        assert read.lists() == [[3]]  # blocks until the forward has run
        assert time.perf_counter() - t0 > 0.02
        assert dev.done(n) and fence.done()
        assert log.waits == 1 and log.kinds == {"read": 1} and reader.waits == 1
        fence.wait()  # done: no wait
        assert log.waits == 1
    finally:
        dev.close()


def test_synchronize_wrapped_swaps_event_and_stream_synchronize_and_puts_them_back() -> None:
    import torch

    before = torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize
    calls: list[tuple[str, Any]] = []

    def wrap(name: str, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def wrapper(self: Any) -> None:
            calls.append((name, fn))

        return wrapper

    with synchronize_wrapped(wrap):
        for cls in (torch.cuda.Event, torch.cuda.Stream):
            sync: Any = cls.synchronize
            sync(None)
    assert calls == [("Event", before[0]), ("Stream", before[1])]
    assert (torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize) == before
