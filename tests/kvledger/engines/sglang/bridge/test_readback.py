"""The host reader: each (tensor, n) read as its first n values (all with None), whatever
the tensor's shape; the CUDA reader is exercised on the H200 by tests/allocator/test_cuda_fence.py
and the bridge's GPU tests."""

from __future__ import annotations

import pytest
import torch

from kvledger.engines.sglang.bridge.readback import HostReader


def test_host_read_takes_the_first_n_of_each_tensor_flattened() -> None:
    base = torch.arange(40, dtype=torch.int64)
    items = [
        (base[3:20], 5),  # a view not at offset 0
        (base[:6].reshape(2, 3), None),  # 2-D: read flattened
        (base[10:30].reshape(4, 5), 7),  # 2-D with a count
        (base[:0], None),  # empty
        (torch.tensor([7], dtype=torch.int32), 1),
    ]
    read = HostReader().read_many(items)
    assert read.ready()
    assert read.lists() == [
        [3, 4, 5, 6, 7],
        [0, 1, 2, 3, 4, 5],
        [10, 11, 12, 13, 14, 15, 16],
        [],
        [7],
    ]
    assert all(type(v) is int for lst in read.lists() for v in lst)


def test_a_cuda_read_gives_its_buffer_back_once_read_and_only_then() -> None:
    """`CudaRead.lists` (the CUDA read's host side, on CPU with a late event): the buffer goes
    back to the reader after the values are copied out, once, however often they are asked
    for; before that the read holds it."""
    from kvledger.engines.sglang.bridge.readback import CudaRead
    from tests.kvledger.engines.sglang.bridge.fakes import FakeEvent

    class Reader:
        def __init__(self) -> None:
            self.waits = 0
            self.given: list[object] = []

        def give_back(self, buffer: object, event: object) -> None:
            self.given.append(buffer)

    buffer, ev, reader = torch.arange(10), FakeEvent(), Reader()
    read = CudaRead(buffer, buffer[:5], [2, 3], ev, reader)
    assert not read.ready() and reader.given == []
    assert read.lists() == [[0, 1], [2, 3, 4]]  # waits for the event: counted
    assert reader.waits == 1 and reader.given == [buffer]
    assert read.lists() == [[0, 1], [2, 3, 4]]
    assert reader.given == [buffer]


@pytest.mark.gpu
def test_cuda_reads_reuse_pinned_buffers_only_once_read() -> None:
    """The CUDA reader against the host one, 60 reads of mixed shapes, counts and dtypes,
    each issued before the previous one is read (two in flight): the values are the host
    reader's, a buffer still being read is never handed to another read, and once read it
    is reused (no new pinned buffer per read)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kvledger.engines.sglang.bridge.readback import CudaReader

    reader, host = CudaReader("cuda:0"), HostReader()
    gen = torch.Generator().manual_seed(7)
    pending = None
    buffers = set()
    for i in range(60):
        n = int(torch.randint(1, 3000, (1,), generator=gen))
        base = torch.randint(0, 1 << 40, (n,), generator=gen)
        items_host = [(base, n // 2), (base[: n - n % 2].reshape(2, -1), None), (base[:0], None)]
        if i % 3 == 0:
            items_host = [(base[: n // 3].to(torch.int32), None)]
        items_dev = [(t.to("cuda:0"), k) for t, k in items_host]
        read = reader.read_many(items_dev)
        if pending is not None:
            prev_read, prev_want, prev_ptr = pending
            assert read._buffer.data_ptr() != prev_ptr  # the one in flight is not reused
            assert prev_read.lists() == prev_want
        buffers.add(read._buffer.data_ptr())
        pending = (read, host.read_many(items_host).lists(), read._buffer.data_ptr())
    assert pending is not None and pending[0].lists() == pending[1]
    assert len(buffers) <= 2 * CudaReader.KEEP  # reused, not one per read (60)
    assert len(reader._free) <= CudaReader.KEEP
