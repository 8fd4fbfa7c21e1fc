"""The SGLang bridge on the GPU: SGLang 0.5.23's DeepSeek-V4 pool on cuda:0, its Triton allocator,
its Triton (`SetKAndS`) and fused (`fused_store_cache`) SWA store kernels and a CUDA graph, all
writing through bridged buffers on `CudaBackend`, byte for byte as into a native pool.

Needs a GPU and SGLang importable (on the lent H200: scripts/gpu-check-sglang, which carries the
wheels and the `sgl_kernel` stand-in); skipped elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest

from accounting.ledger import Ledger
from kvledger.engines.sglang.bridge import ENV_ENABLE, attach
from kvledger.tools.bench.sglang_engine import PAGE, Engine, Request, Shape, published

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]

DEV = "cuda:0"
SHAPE = Shape(layers=4, swa_pages=96, full_pages=192, requests=8, max_context=4096)
# Emptied pages go back as soon as their GPU work is done: no spares, no kept handles, no grace,
# nothing mapped ahead.
EXACT = {"max_spare_pages": 0, "handle_pool_pages": 0, "unmap_grace_s": 0.0, "map_ahead": False}
DATA, SCALES = 576, 7  # V4 page: 256 rows of 576 data bytes, then 256 x 8 scale bytes (7 used)
MIB = 1 << 20
TRITON_LAYERS = tuple(range(0, SHAPE.layers, 2))  # written by SetKAndS (Triton)
FUSED_LAYERS = tuple(range(1, SHAPE.layers, 2))  # written by fused_store_cache


@pytest.fixture(scope="module", autouse=True)
def _context() -> Iterator[None]:
    with published():
        yield


def _inputs(n: int, seed: int) -> tuple[Any, Any]:
    """Deterministic store inputs for `n` tokens: the Triton store's pack and the fused
    store's bf16 [n, 512] latent."""
    import torch
    from sglang.kernels.ops.kvcache.dsv4_main_kv_store import NopeFp8RopeBf16Pack

    g = torch.Generator(device=DEV).manual_seed(seed)
    pack = NopeFp8RopeBf16Pack(
        k_nope_fp8=torch.randn(n, 448, generator=g, device=DEV).to(torch.float8_e4m3fn),
        k_rope_bf16=torch.randn(n, 64, generator=g, device=DEV).to(torch.bfloat16),
        scale_k_nope_ue8m0=torch.randint(
            100, 140, (n, 7), generator=g, device=DEV, dtype=torch.uint8
        ),
    )
    latent = torch.randn(n, 512, generator=g, device=DEV).to(torch.bfloat16)
    return pack, latent


class Side:
    """One engine and what it stored: `TRITON_LAYERS` through the Triton store,
    `FUSED_LAYERS` through the fused store."""

    def __init__(self, engine: Engine) -> None:
        self.e = engine
        self.triton_stores = 0
        self.fused_stores = 0

    def swa_loc(self, req: Request, start: int, end: int) -> Any:
        full = self.e.r2t.req_to_token[req.kv.req_pool_idx, start:end].long()
        return self.e.allocator.translate_loc_from_full_to_swa(full)

    def store(self, loc: Any, seed: int, layers: tuple[int, ...] | None = None) -> None:
        pool = self.e.pool
        for layer in range(SHAPE.layers) if layers is None else layers:
            pack, latent = _inputs(loc.numel(), seed * 100 + layer)
            if layer in TRITON_LAYERS:
                pool.set_swa_key_buffer(layer, loc, pack)
                self.triton_stores += 1
            else:
                pool.set_swa_key_buffer_radix_fused(layer, loc, latent)
                self.fused_stores += 1

    def prefill(self, n: int, seed: int) -> Request:
        req = self.e.prefill(n)
        self.store(self.swa_loc(req, 0, n), seed)
        return req

    def token_bytes(self, layer: int, loc: Any) -> Any:
        """[tokens, 583]: each token's 576 data bytes and 7 scale bytes in `layer`."""
        import torch

        buf = self.e.pool.swa_kv_pool.kv_buffer[layer]
        flat = buf.view(-1)
        page, slot = loc // PAGE, loc % PAGE
        base = page * buf.shape[1]
        data = base[:, None] + slot[:, None] * DATA + torch.arange(DATA, device=DEV)
        scales = base[:, None] + PAGE * DATA + slot[:, None] * 8 + torch.arange(SCALES, device=DEV)
        return torch.cat([flat[data], flat[scales]], dim=1)

    def live(self) -> list[Any]:
        """Every live token's bytes (tokens still in the window of a running request)."""
        from sglang.srt.mem_cache.base_prefix_cache import ComponentType

        out = []
        for req in self.e.running:
            start = req.kv.get_evicted_seqlen(ComponentType.SWA)
            loc = self.swa_loc(req, start, req.seq_len)
            out += [self.token_bytes(layer, loc) for layer in range(SHAPE.layers)]
        return out


class Graph:
    """A CUDA graph that captured one decode step's Triton stores (`SetKAndS`, one token per
    running request) into the even layers of `side`'s pool; replayed with new locations and
    inputs each step."""

    def __init__(self, side: Side, batch: int) -> None:
        import torch

        self.side = side
        self.loc = torch.zeros(batch, dtype=torch.int64, device=DEV)  # page 0: padding rows
        self.packs = {layer: _inputs(batch, seed=-1 - layer)[0] for layer in TRITON_LAYERS}
        self.replays = 0
        warm = torch.cuda.Stream(DEV)
        warm.wait_stream(torch.cuda.current_stream(DEV))
        with torch.cuda.stream(warm):
            self._stores()  # compiles and loads the kernel before capture
        torch.cuda.current_stream(DEV).wait_stream(warm)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._stores()

    def _stores(self) -> None:
        for layer, pack in self.packs.items():
            self.side.e.pool.set_swa_key_buffer(layer, self.loc, pack)

    def replay(self, loc: Any, seed: int) -> None:
        self.loc.copy_(loc)
        for layer, pack in self.packs.items():
            new = _inputs(loc.numel(), seed * 100 + layer)[0]
            pack.k_nope_fp8.copy_(new.k_nope_fp8)
            pack.k_rope_bf16.copy_(new.k_rope_bf16)
            pack.scale_k_nope_ue8m0.copy_(new.scale_k_nope_ue8m0)
        self.graph.replay()
        self.replays += 1


def _decode(native: Side, bridged: Side, graph: Graph, steps: int, seed: int) -> None:
    """Window eviction + one token per running request. Even layers: the Triton store, eager
    into the native pool and by the graph into the bridged one; odd layers: the fused store,
    eager into both."""
    import torch

    for step in range(steps):
        locs = []
        for side in (native, bridged):
            side.e.evict_windows()
            side.e.decode()
            locs.append(
                torch.cat([side.swa_loc(r, r.seq_len - 1, r.seq_len) for r in side.e.running])
            )
        native.store(locs[0], seed + step)
        graph.replay(locs[1], seed + step)
        bridged.store(locs[1], seed + step, layers=FUSED_LAYERS)


def _nvml_used() -> int:
    from accounting.nvml import used_bytes

    return used_bytes(0)


def test_sglang_kernels_write_through_bridged_buffers_as_into_a_native_pool() -> None:
    import torch

    native, bridged = Side(Engine(SHAPE, DEV)), Side(Engine(SHAPE, DEV))
    alloc = bridged.e.allocator
    assert alloc.swa_attn_allocator.use_triton_kernels  # SGLang's Triton allocator, for real
    bridge = attach(
        bridged.e.pool, Ledger(), allocator=alloc, env={ENV_ENABLE: "1"}, require=True,
        pool_options=EXACT,
    )  # fmt: skip
    try:
        assert bridge.active and type(bridge.backend).__name__ == "CudaBackend"
        bufs = bridged.e.pool.swa_kv_pool.kv_buffer
        assert all(t.device == torch.device(DEV) for t in bufs)

        # Prefill two requests and decode them past the window's page boundary.
        for side in (native, bridged):
            side.prefill(700, seed=1)
            side.prefill(300, seed=2)
        graph = Graph(bridged, batch=2)
        _decode(native, bridged, graph, steps=300, seed=1000)
        a, b = bridged.e.running
        assert a.seq_len == 1000 and b.seq_len == 600
        assert bridged.e.held_swa_pages() == native.e.held_swa_pages() == 1 + 2  # window evicted

        # Fill 48 more pages, then finish them and one running request: NVML falls by the
        # physical bytes the bridge released.
        for side in (native, bridged):
            for i in range(3):
                side.prefill(4096, seed=10 + i)
        torch.cuda.synchronize(DEV)
        used0, reserved0 = _nvml_used(), torch.cuda.memory_reserved(DEV)
        phys0 = bridge.stats()["physical_bytes"]
        for side in (native, bridged):
            for req in side.e.running[1:]:
                side.e.finish(req)
        torch.cuda.synchronize(DEV)
        assert bridge.wait_idle()  # the mapper unmaps once the fences of the freed pages passed
        used1, reserved1 = _nvml_used(), torch.cuda.memory_reserved(DEV)
        released = phys0 - bridge.stats()["physical_bytes"]
        # 50 rows freed around 1 kept: at least two VMM pages of every layer emptied.
        backend = bridge.backend
        assert backend is not None
        assert released >= 2 * SHAPE.layers * backend.granularity
        nvml_drop = used0 - used1
        assert abs(nvml_drop - released - (reserved0 - reserved1)) <= 2 * MIB, (
            nvml_drop,
            released,
        )

        # Re-admission maps pages again; the graph captured before the unmaps still writes.
        for side in (native, bridged):
            side.prefill(2000, seed=3)
        _decode(native, bridged, graph, steps=200, seed=5000)
        torch.cuda.synchronize(DEV)
        got, want = bridged.live(), native.live()
        assert len(got) == len(want) == 2 * SHAPE.layers
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and g.shape[0] > 0
            assert torch.equal(g, w)
        assert sum(int(g.count_nonzero()) for g in got) > 0
        print(
            f"ran for real on {torch.cuda.get_device_name(0)}: SGLang "
            f"{type(bridged.e.pool).__name__} on {bufs[0].device} with "
            f"{type(alloc).__name__} (Triton allocator kernels: "
            f"{alloc.swa_attn_allocator.use_triton_kernels}); bridge on "
            f"{type(bridge.backend).__name__}; eager stores: SetKAndS (Triton) "
            f"{bridged.triton_stores}, fused_store_cache {bridged.fused_stores}; CUDA graph of "
            f"SetKAndS stores replayed {graph.replays} times (200 after pages were unmapped and "
            f"remapped); NVML fell "
            f"{nvml_drop / MIB:.1f} MiB for {released / MIB:.1f} MiB released "
            f"(torch reserved {(reserved0 - reserved1) / MIB:+.1f} MiB)"
        )
    finally:
        bridge.detach()
    assert cast(Any, bridge.backend).closed


def test_a_page_is_unmapped_only_after_the_gpu_work_reading_it_is_done() -> None:
    """A kernel on another stream (as the overlap scheduler's forward runs) still reads a page
    when SGLang frees it; the bridge must not unmap it under that kernel (an unmapped read
    faults the context, and the copy below would not hold the page's bytes)."""
    import torch

    side = Side(Engine(SHAPE, DEV))
    bridge = attach(
        side.e.pool, Ledger(), allocator=side.e.allocator, env={ENV_ENABLE: "1"}, require=True,
        pool_options=EXACT,
    )  # fmt: skip
    try:
        side.prefill(14 * PAGE, seed=7)  # rows 1..14: VMM page 0 and the start of page 1
        req = side.prefill(16 * PAGE, seed=8)  # rows 15..30: row 30 alone in VMM page 2
        row = max(int(p) for p in (side.swa_loc(req, 0, req.seq_len) // PAGE).tolist())
        buf = side.e.pool.swa_kv_pool.kv_buffer[0]
        torch.cuda.synchronize(DEV)
        expected = buf[row].clone()
        assert int(expected.count_nonzero()) > 0
        mapped = bridge.stats()["mapped_pages"]
        reader = torch.cuda.Stream(DEV)
        with torch.cuda.stream(reader):
            torch.cuda._sleep(500_000_000)  # about 0.25 s at H200 clocks
            seen = buf[row].clone()
        side.e.finish(req)  # SGLang frees the pages while `reader` has not read yet
        torch.cuda.synchronize(DEV)
        assert torch.equal(seen, expected)
        assert bridge.wait_idle()
        assert bridge.stats()["mapped_pages"] < mapped  # the page did go
    finally:
        bridge.detach()


def test_detach_beside_a_gpu_hog_carries_every_row_back() -> None:
    """Issue 23: beside another process running bf16 matmuls, `Bridge.detach()` faulted
    (`cudaErrorIllegalAddress`, 2 of 2 runs): its copy-back into native buffers was still
    queued when the store unmapped the pages. The store's close now drains the device first.
    In a child process (a fault kills its CUDA context), beside a hog child; every byte of
    every held row and the padding row checked in the native buffers.

        # what it catches, without the drain (expect an error or wrong bytes):
        python -m tests.kvledger.engines.sglang.bridge.detach_busy_child --no-drain
    """
    from tests.allocator.cuda_busy_probe import beside_a_hog

    got = beside_a_hog(
        ["tests.kvledger.engines.sglang.bridge.detach_busy_child"], hog_seconds=200, timeout=200
    )
    assert got == {"rounds": 5, "wanted": 5, "wrong_bytes": 0, "error": "", "drain": True}
