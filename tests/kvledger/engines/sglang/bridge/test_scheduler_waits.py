"""The waits the bridge makes on SGLang's scheduler thread, counted on the CPU.

The bridge's id reader is replaced by the serving bench's `ModelReader`
(`kvledger.tools.bench.sglang_waits`): its reads and fences land only once the forwards
launched before them have run (CUDA's order under SGLang's overlap loop, whose WAR barrier
puts the scheduler's stream behind the forward in flight), and a wait for one before that
blocks and is counted. Each scheduler step below runs with a forward in flight, as under
the overlap loop.

What it shows: admissions, decode, window eviction, finishes and compaction wait for
nothing. A compaction step whose journal holds ids still landing behind the forward moves
nothing and is counted as deferred; one with the journal replayed moves rows with the
forward in flight, leaving its copies' fence unwaited (the pages it empties are unmapped once
it signals); with no forward in flight (SGLang's `on_idle`, where the plugin compacts under
the overlap loop) it moves rows and waits for nothing either.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from accounting.ledger import Ledger
from kvledger.engines.sglang.bridge import ENV_ENABLE, attach
from kvledger.engines.sglang.bridge.compact_policy import CompactionPolicy
from kvledger.tools.bench.sglang_engine import Shape, published
from kvledger.tools.bench.sglang_forward import HostDevice
from kvledger.tools.bench.sglang_loop import ServingEngine
from kvledger.tools.bench.sglang_waits import WaitLog, model_reader

pytestmark = pytest.mark.sglang

SHAPE = Shape(layers=2, swa_pages=256, full_pages=1024, requests=130, max_context=4096)
FORWARD_S = 0.03


class Rig:
    def __init__(self, engine: ServingEngine, bridge: Any, dev: HostDevice, log: WaitLog) -> None:
        self.e, self.bridge, self.dev, self.log = engine, bridge, dev, log
        self.reqs: list[Any] = []

    def in_flight(self) -> int:
        """Launch a forward: what the scheduler does next overlaps it."""
        return self.dev.launch(FORWARD_S)

    def waits_of(self, fn: Any) -> int:
        before = self.log.waits
        fn()
        return self.log.waits - before


@pytest.fixture
def rig() -> Iterator[Rig]:
    dev = HostDevice()
    log = WaitLog()
    log.owner = threading.get_ident()
    with published():
        e = ServingEngine(SHAPE, "cpu")
        bridge = attach(
            e.pool, Ledger({}), allocator=e.allocator, env={ENV_ENABLE: "1"}, require=True
        )
        model_reader(bridge, dev, log)
        try:
            yield Rig(e, bridge, dev, log)
        finally:
            dev.wait(dev.launched)
            bridge.detach()
            dev.close()


def test_admission_decode_eviction_and_finish_wait_for_nothing(rig: Rig) -> None:
    e = rig.e
    per_step = []
    for step in range(60):
        n = rig.in_flight()
        waits = 0
        if step % 3 == 0 and len(rig.reqs) < 30:  # an admission
            req = e.admit(300 + 37 * step)
            assert req is not None
            rig.reqs.append(req)
        waits += rig.waits_of(lambda: e.evict_windows(rig.reqs))
        waits += rig.waits_of(lambda: e.decode_some(rig.reqs))
        if step % 4 == 3 and rig.reqs:  # a finish
            waits += rig.waits_of(lambda: e.release(rig.reqs.pop(0)))
        per_step.append(waits)
        rig.dev.wait(n)  # the loop's own wait, not the bridge's
    stats = rig.bridge.stats()
    assert per_step == [0] * 60, per_step
    assert stats["replays"] > 0  # the journal was replayed all along, without waiting
    assert stats["readback_waits"] == 0 and stats["forced_replays"] == 0


def _fragment(rig: Rig) -> None:
    """Many one-page requests, two of every three finished: held rows scattered over pages."""
    e = rig.e
    reqs: list[Any] = [e.admit(200) for _ in range(120)]
    assert all(r is not None for r in reqs)
    for r in reqs[::3] + reqs[1::3]:
        e.release(r)
    rig.reqs = list(reqs[2::3])
    rig.dev.wait(rig.dev.launched)
    rig.bridge.wait_idle()


def test_a_compaction_step_behind_reads_in_flight_defers_without_waiting(rig: Rig) -> None:
    _fragment(rig)
    policy = CompactionPolicy()
    assert policy.due(rig.bridge)
    e = rig.e
    n = rig.in_flight()
    e.release(rig.reqs.pop())  # a finish the replay has to read, behind the forward
    moved = -1

    def step() -> None:
        nonlocal moved
        moved = policy.step(rig.bridge)

    assert rig.waits_of(step) == 0, rig.log.kinds
    assert moved == 0 and rig.bridge.compactions_deferred == 1
    assert rig.log.blocked_s == 0
    rig.dev.wait(n)  # the forward has run: the read has landed, the next step compacts
    assert rig.waits_of(step) == 0 and moved > 0


def test_a_compaction_step_with_a_forward_in_flight_moves_rows_without_waiting(
    rig: Rig,
) -> None:
    """The journal replayed, a forward in flight: the rows move; the fence behind the copies
    lands behind the forward and is not waited for. The pages it empties are unmapped once
    it has signalled, by a later trim or the background mapper."""
    _fragment(rig)
    policy = CompactionPolicy()
    n = rig.in_flight()
    mapped_before = rig.bridge.store.stats()["mapped_pages"]
    moved = 0

    def step() -> None:
        nonlocal moved
        moved = policy.step(rig.bridge)

    assert rig.waits_of(step) == 0, rig.log.kinds
    assert moved > 0 and rig.log.blocked_s == 0
    rig.dev.wait(n)
    assert rig.bridge.wait_idle()
    assert rig.bridge.store.stats()["mapped_pages"] < mapped_before  # the emptied pages went


def test_a_compaction_step_with_nothing_in_flight_waits_for_nothing(rig: Rig) -> None:
    _fragment(rig)
    policy = CompactionPolicy()
    moved = 0

    def step() -> None:
        nonlocal moved
        moved = policy.step(rig.bridge)

    assert rig.waits_of(step) == 0
    assert moved > 0


def test_detach_waits_for_the_device_drain_and_says_so(rig: Rig) -> None:
    """Detach waits by design (it unmaps, so every access queued before must be done): the
    page store's drain, a no-op in host memory, is a modelled wait for the forward in
    flight, as on CUDA, so the host proof does not read detach as free."""
    _fragment(rig)
    rig.log.kinds.clear()
    rig.in_flight()
    assert rig.waits_of(rig.bridge.detach) == 1
    assert dict(rig.log.kinds) == {"device drain": 1}, dict(rig.log.kinds)
