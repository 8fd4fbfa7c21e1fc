"""Compaction of a bridged SGLang pool (kvledger.engines.sglang.bridge.compact, allocator.rows.compaction)
against SGLang 0.5.23's own DeepSeek-V4 pool and allocator: on CPU with the host VMM backend
at 2 MiB (14 SWA rows per VMM page), and on cuda:0 with the CUDA backend and SGLang's Triton
allocator kernels (marker gpu)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from allocator.host import HostBackend
from allocator.rows import packing
from kvledger.tools.bench.sglang_engine import PAGE, Engine, Request, Shape, published
from tests.kvledger.engines.sglang.rig import bridged

pytestmark = pytest.mark.sglang

CHURN_EVENTS = 400
# 3.5 SWA rows per VMM page: most pages in use lose a row to a straddle
SMALL_GRANULARITY = 512 * 1024


@pytest.fixture(params=["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def scattered(request: pytest.FixtureRequest) -> Iterator[tuple[Engine, Any, list[Request]]]:
    """40 one-page requests admitted, then two of every three finished at random: the
    survivors' rows scattered over the VMM pages."""
    device = request.param
    with published():
        e = Engine(
            Shape(layers=2, swa_pages=64, full_pages=96, requests=48, max_context=512), device
        )
        backend = HostBackend() if device == "cpu" else None  # None: the bridge's CudaBackend
        # no spares: the pages the survivors leave beyond the packed ones are the excess,
        # whatever the map-ahead did
        bridge = bridged(e, backend, name="compaction", max_spare_pages=0, grace_pages=0)
        try:
            reqs = [e.prefill(PAGE) for _ in range(40)]
            rng = random.Random(5)
            for req in rng.sample(reqs, 27):
                e.finish(req)
            bridge.flush()
            yield e, bridge, list(e.running)
        finally:
            bridge.detach()
            if backend is not None:
                backend.close()


def token_rows(e: Engine, reqs: list[Request]) -> dict[tuple[int, int], int]:
    """(request, token) -> the SWA row SGLang reads it from now, through its own mapping."""
    out = {}
    for k, req in enumerate(reqs):
        full = e.r2t.req_to_token[req.kv.req_pool_idx, : req.seq_len].long()
        rows = e.allocator.translate_loc_from_full_to_swa(full) // PAGE
        for pos, row in enumerate(rows.tolist()):
            out[(k, pos)] = row
    return out


def mark_rows(layers: list[Any], rows: dict[tuple[int, int], int]) -> None:
    """Fill each row the tokens read with a byte of its own per layer."""
    for i, t in enumerate(layers):
        for row in set(rows.values()):
            t[row].fill_((row * 7 + i) % 251)


def check_rows(
    layers: list[Any], before: dict[tuple[int, int], int], after: dict[tuple[int, int], int]
) -> None:
    """Every token reads, from its row now, the bytes its row held before."""
    for key, row in after.items():
        for i, t in enumerate(layers):
            assert bool((t[row] == (before[key] * 7 + i) % 251).all()), (key, row)


def pages_in_use(bridge: Any) -> int:
    return bridge.store.in_use.count(1)


def test_compaction_moves_rows_and_every_token_reads_the_same_bytes(
    scattered: tuple[Engine, Any, list[Request]],
) -> None:
    e, bridge, live = scattered
    before = token_rows(e, live)
    layers = e.pool.swa_kv_pool.kv_buffer
    mark_rows(layers, before)
    in_use, mapped = pages_in_use(bridge), bridge.stats()["mapped_pages"]
    moved = bridge.compact()
    assert moved > 0 and bridge.stats()["rows_moved"] == moved
    after = token_rows(e, live)
    assert after.keys() == before.keys() and after != before
    check_rows(layers, before, after)
    # The follower holds what SGLang holds; fewer pages in use, the emptied ones unmapped.
    held = sorted(set(after.values()))
    assert bridge.follower.held().tolist() == bridge.policy.held_by_engine() == held
    assert bridge.wait_idle()  # CUDA: the emptied pages go once the device passed the copies
    assert pages_in_use(bridge) < in_use and bridge.stats()["mapped_pages"] < mapped
    assert not packing.fragmented(bridge.follower)
    assert bridge.compact() == 0  # nothing left to gain
    # SGLang carries on over the moved rows: decode, then free them through the mapping.
    for _ in range(3):
        e.decode()
    e.sync()
    e.finish_all()
    e.sync()
    bridge.flush()
    assert bridge.follower.held_rows == 0 and bridge.follower.divergences == 0
    assert e.held_swa_pages() == 0


def test_compaction_behind_a_busy_stream_unmaps_only_after_its_copies(
    scattered: tuple[Engine, Any, list[Request]],
) -> None:
    """Compaction does not wait for its copies: on CUDA, with a long kernel queued ahead of
    them on the same stream, it returns at once and unmaps nothing; the pages it emptied go
    only once the copies have run (the background mapper waits for their event off this
    thread), and every token still reads its bytes: an unmap before the copies would fault
    them (an illegal address) or lose the rows."""
    import time

    import torch

    e, bridge, live = scattered
    before = token_rows(e, live)
    layers = e.pool.swa_kv_pool.kv_buffer
    mark_rows(layers, before)
    cuda = layers[0].is_cuda
    assert bridge.wait_idle(timeout=30.0)  # the fixture's finishes: their pages gone first
    if cuda:
        torch.cuda.synchronize()
    unmapped0 = bridge.stats()["pages_unmapped_total"]
    if cuda:
        torch.cuda._sleep(1_000_000_000)  # several hundred ms on the stream the copies join
    t0 = time.perf_counter()
    moved = bridge.compact()
    took = time.perf_counter() - t0
    assert moved > 0
    if cuda:
        busy = not torch.cuda.current_stream().query()
        assert busy, "the kernel ahead finished before the check: nothing was proven"
        assert bridge.stats()["pages_unmapped_total"] == unmapped0, "unmapped before the copies"
        assert took < 0.2, f"compact() waited {took:.3f} s for the device"
    assert bridge.wait_idle(timeout=30.0)
    if cuda:
        torch.cuda.synchronize()
    assert bridge.stats()["pages_unmapped_total"] > unmapped0  # the emptied pages went, after
    check_rows(layers, before, token_rows(e, live))


def test_the_warm_up_runs_the_compaction_kernels_and_changes_nothing_of_the_engine(
    scattered: tuple[Engine, Any, list[Request]],
) -> None:
    import torch

    from kvledger.engines.sglang.bridge.compact import warm_up

    e, bridge, reqs = scattered
    on_device = e.device != "cpu"
    assert bridge.compaction_warmed == on_device  # attach warms a device pool only
    assert bridge.stats()["compaction_warmed"] == int(on_device)
    rows = token_rows(e, reqs)
    mark_rows(bridge.tensors, rows)
    mapping = e.allocator.full_to_swa_index_mapping.clone()
    free = bridge.policy.allocator.free_pages.clone()
    mapped = bridge.store.stats()["mapped_pages"]
    assert warm_up(bridge, host=True)
    if on_device:
        torch.cuda.synchronize()
    assert torch.equal(e.allocator.full_to_swa_index_mapping, mapping)
    assert torch.equal(bridge.policy.allocator.free_pages, free)
    assert token_rows(e, reqs) == rows
    check_rows(bridge.tensors, rows, rows)  # (only rows in use: the others may be unmapped)
    assert bridge.store.stats()["mapped_pages"] == mapped


def test_compaction_refuses_another_thread(
    scattered: tuple[Engine, Any, list[Request]],
) -> None:
    import threading

    _, bridge, _ = scattered
    errors: list[BaseException] = []

    def other() -> None:
        try:
            bridge.compact()
        except RuntimeError as err:
            errors.append(err)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1 and "between batches on the scheduler's thread" in str(errors[0])
    assert bridge.stats()["rows_moved"] == 0


def test_after_every_compaction_the_mapped_pages_are_within_the_packed_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`kvledger bench sglang`'s churn (random admissions of 1..4096 tokens and finishes,
    sweeping between 10% and 90% of the SWA pages), a compaction after each event: the pages
    mapped never exceed ceil((held rows + 1) / rows per VMM page) + max spare pages + 1,
    the bound the benchmark checks, and the slide (what is left when no page empties into
    the others) is among the plans that got there."""
    import math

    from allocator.rows import compaction
    from kvledger.tools.bench.sglang_cases import Churn

    slides: list[int] = []
    slide = compaction.slide

    def counting(*args: Any, **kwargs: Any) -> tuple[list[int], list[int]]:
        out = slide(*args, **kwargs)
        slides.append(len(out[0]))
        return out

    monkeypatch.setattr(compaction, "slide", counting)
    swa_pages = 256
    shape = Shape(layers=2, swa_pages=swa_pages, full_pages=384, requests=160, max_context=4096)
    with published():
        e = Engine(shape, "cpu")
        with HostBackend(SMALL_GRANULARITY) as backend:
            bridge = bridged(e, backend, name="compaction")  # the bridge's own spare policy
            try:
                rows_per_page = backend.granularity / e.pool.swa_kv_pool.kv_buffer[0].shape[1]
                spares = bridge.store.policy.max_spare_pages
                churn = Churn(11, swa_pages)
                for _ in range(CHURN_EVENTS):
                    churn.event(e)
                    bridge.compact()
                    held = e.held_swa_pages()
                    bound = math.ceil((held + 1) / rows_per_page) + spares + 1
                    st = bridge.stats()
                    assert st["mapped_pages"] <= bound, (
                        held,
                        bridge.store.in_use.count(1),
                        list(bridge.store.spares),
                        list(bridge.store.policy.pinned),
                        st,
                    )
                assert bridge.follower.divergences == 0
                assert bridge.follower.held().tolist() == bridge.policy.held_by_engine()
            finally:
                bridge.detach()
    assert any(slides), f"no slide moved a row ({len(slides)} slides): not the case it is for"
