"""kvledger.engines.sglang.bridge.journal on host tensors (no sglang): what a batch reads, how moves
net out, and the depth bound (`net`, `peak`) the front policy pins against."""

from __future__ import annotations

from typing import Any

import torch

from kvledger.engines.sglang.bridge.journal import MERGE, RELEASE, TAKE, Journal
from kvledger.engines.sglang.bridge.readback import HostReader


class CountingReader(HostReader):
    def __init__(self) -> None:
        self.reads = 0

    def read_many(self, items: list[tuple[Any, int | None]]) -> Any:
        self.reads += 1
        return super().read_many(items)


class Stack:
    """SGLang's free list for these calls: releases in front, allocations from the front;
    the list replaced, never written in place."""

    def __init__(self, rows: int) -> None:
        self.free = torch.arange(1, rows, dtype=torch.int64)

    def take(self, j: Journal, n: int) -> list[int]:
        fp0 = self.free
        self.free = fp0[n:]
        j.net += n
        j.raw.append((TAKE, fp0, n, j.net))
        return fp0[:n].tolist()

    def release(self, j: Journal, rows: list[int]) -> None:
        ids = torch.tensor(rows, dtype=torch.int64)
        self.free = torch.cat((ids, self.free))
        j.net -= len(rows)
        j.raw.append((RELEASE, (ids,), j.net))


def held_flags(rows: int, held: set[int]) -> bytearray:
    out = bytearray(rows)
    for r in held:
        out[r] = 1
    return out


def test_a_batch_is_one_read_and_replays_in_order() -> None:
    reader = CountingReader()
    j, s = Journal(reader), Stack(16)
    a = s.take(j, 3)
    s.release(j, a[:1])
    b = s.take(j, 2)  # the released row first, then the next of the list
    assert b == [a[0], 4]
    j.drain((s.free, 5))
    assert reader.reads == 1 and len(j) == 1
    take, give, releases, front = j.replay(wait=False, held=held_flags(16, set()))
    assert sorted(take) == [1, 2, 3, 4] and give == [] and releases == 1
    assert front == s.free[:5].tolist()
    assert len(j) == 0 and j.replayed_net == j.net == 4


def test_moves_net_out_against_the_follower() -> None:
    j, s = Journal(HostReader()), Stack(16)
    held = {1, 2}
    s.free = torch.arange(3, 16, dtype=torch.int64)
    s.release(j, [1])  # held, released ...
    again = s.take(j, 1)  # ... and taken again: never left the engine
    assert again == [1]
    c = s.take(j, 2)
    s.release(j, c)  # taken and released: never reaches the follower
    s.release(j, [2])  # released for good
    j.drain((s.free, 4))
    take, give, _, _ = j.replay(wait=True, held=held_flags(16, held))
    assert take == [] and give == [2]


def test_net_and_peak_bound_the_depth_reached_into_the_front() -> None:
    j, s = Journal(HostReader()), Stack(32)
    j.drain((s.free, 8))
    j.replay(wait=True, held=held_flags(32, set()))
    ref = j.replayed_net
    front = s.free[:8].tolist()
    got = s.take(j, 3)  # 3 deep
    s.release(j, got[1:])  # two back in front ...
    got += s.take(j, 2)  # ... taken first: still 3 deep
    got += s.take(j, 1)  # 4 deep
    assert j.peak() == ref + 4 == j.net
    assert set(got) == set(front[:4])  # what was taken lies within the first peak - ref rows


def test_a_merge_is_seen_until_it_is_replayed() -> None:
    j, s = Journal(HostReader()), Stack(8)
    assert not j.merged() and j.peak() is None
    j.raw.append((MERGE, j.net))
    assert j.merged()
    j.drain((s.free, 4))
    assert j.merged()  # drained, not replayed
    j.replay(wait=True, held=held_flags(8, set()))
    assert not j.merged()


def test_clear_forgets_what_was_recorded() -> None:
    j, s = Journal(HostReader()), Stack(8)
    s.take(j, 2)
    j.drain((s.free, 4))
    s.take(j, 1)
    j.clear()
    assert len(j) == 0 and j.peak() is None and j.replayed_net == j.net == 3
