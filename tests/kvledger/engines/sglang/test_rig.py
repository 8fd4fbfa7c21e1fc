"""The CPU rig of the `sglang` tests stays on SGLang's torch-native paths on every machine."""

from __future__ import annotations

import types

import pytest

from tests.kvledger.engines.sglang import rig

pytestmark = pytest.mark.sglang


def test_rig_pins_the_torch_native_paths_where_sglang_would_pick_triton(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where CUDA is present SGLang's platform offers Triton, and its paged allocator takes
    it whatever the pool's device; the rig's CPU allocators must not, or every allocation
    launches a Triton kernel on CPU tensors. Simulated here by a platform that offers
    Triton: without the pin the prefill below fails."""
    import sglang.srt.mem_cache.allocator.paged as paged

    offers_triton = types.SimpleNamespace(capabilities=types.SimpleNamespace(supports_triton=True))
    monkeypatch.setattr(paged, "current_platform", offers_triton)
    with rig.published():
        pool = rig.make_pool()
        r2t = rig.make_req_to_token()
        alloc = rig.make_allocator(pool, r2t)
        assert alloc.swa_attn_allocator.use_triton_kernels is False
        assert alloc.full_attn_allocator.use_triton_kernels is False
        sched = rig.Scheduler(alloc, r2t)
        a = sched.prefill(300)
        for _ in range(213):  # 300 -> 513: crosses into a third page
            sched.decode([a])
        assert alloc.swa_available_size() == alloc.size_swa - 3 * rig.PAGE
        sched.evict_window(a)
        sched.finish(a)
        assert alloc.swa_available_size() == alloc.size_swa
