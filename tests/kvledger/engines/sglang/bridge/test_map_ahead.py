"""Map-ahead after a churn (kvledger.engines.sglang.bridge.front_policy, allocator.rows.front) against SGLang
0.5.23's own DeepSeek-V4 pool and allocator on CPU, with the host VMM backend at 2 MiB (14
SWA rows per VMM page): the rows SGLang hands out next have their pages mapped or announced
to the background mapper, even where the free list interleaves a spare's rows with an
unmapped page's."""

from __future__ import annotations

from typing import Any

import pytest

from allocator.host import HostBackend
from allocator.states import PageState
from kvledger.engines.sglang.bridge.front_policy import FrontPolicy
from kvledger.tools.bench.sglang_cases import Churn
from kvledger.tools.bench.sglang_engine import Engine, Shape, published
from tests.kvledger.engines.sglang.rig import bridged

pytestmark = pytest.mark.sglang

PROMPT = 1000  # 4 SGLang pages, 3 of them out of the window once admitted
REQUESTS = 256
CYCLES = 3


def test_the_next_rows_pages_are_mapped_or_announced_in_a_fill_after_a_churn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After every replay of a fill that follows a churn (whose packing and compaction leave
    SGLang's free list in no address order), the pages of the next 2 x (the widest
    allocation, 4 rows) rows of the front just read are mapped or in the store's ahead list.
    With only one page not in use announced (a spare at the front used it up) the page after
    it was announced a replay too late, and fill/drain cycles after a churn waited on the
    driver (CPU diagnostics: 1 to 5 allocations in each of four runs)."""
    misses: list[tuple[int, list[int]]] = []
    checked_pins = 0
    pin = FrontPolicy.pin
    filling = False
    widest = -(-PROMPT // 256)

    def checked(self: FrontPolicy, front: list[int], **kw: Any) -> None:
        nonlocal checked_pins
        pin(self, front, **kw)
        if not filling:
            return
        checked_pins += 1
        store, f = self.follower.store, self.follower
        rows = front[: 2 * widest]
        pages = {int(q) for row in rows for q in f.row_pages[row]}
        missing = sorted(
            q for q in pages if store.state[q] != PageState.MAPPED and q not in store.policy.ahead
        )
        if missing:
            misses.append((checked_pins, missing))  # (which pin of the fills, pages)

    monkeypatch.setattr(FrontPolicy, "pin", checked)
    shape = Shape(layers=2, swa_pages=1024, full_pages=1536, requests=300, max_context=4096)
    with published():
        e = Engine(shape, "cpu")
        with HostBackend() as backend:
            bridge = bridged(e, backend, name="map-ahead")
            try:
                churn = Churn(13, shape.swa_pages)
                for _ in range(300):
                    churn.event(e)
                    bridge.compact()
                e.finish_all()
                bridge.flush()
                filling = True
                for _ in range(CYCLES):  # fill/drain cycles, as `kvledger bench sglang` runs
                    for _ in range(REQUESTS):
                        req = e.prefill(PROMPT)
                        e.evict_windows([req])
                    for req in list(e.running):
                        e.finish(req)
                bridge.flush()
                filling = False
                f, policy = bridge.follower, bridge.policy
                assert f is not None and policy is not None
                assert f.divergences == 0
                assert f.held().tolist() == policy.held_by_engine()
            finally:
                bridge.detach()
    assert checked_pins >= 10 * CYCLES, f"only {checked_pins} pins checked in the fills"
    assert not misses, f"pages of the next rows neither mapped nor announced: {misses[:5]}"
