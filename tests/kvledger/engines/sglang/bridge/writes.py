"""Writes through SGLang's own SWA store into a bridged pool and a native one; prints JSON.

    TRITON_INTERPRET=1 python -m tests.kvledger.engines.sglang.bridge.writes

Run by test_sglang_bridge in a subprocess (Triton reads TRITON_INTERPRET when
SGLang's kernels are defined, so it must be set before sglang is imported).
"""

from __future__ import annotations

import json
import logging
import sys

import torch

from accounting.ledger import Ledger
from allocator.host import HostBackend
from kvledger.engines.sglang.bridge import ENV_ENABLE, attach
from tests.kvledger.engines.sglang import rig

GRAN = 48 * 4096


def _pack(n: int, seed: int) -> object:
    from sglang.kernels.ops.kvcache.dsv4_main_kv_store import NopeFp8RopeBf16Pack

    g = torch.Generator().manual_seed(seed)
    return NopeFp8RopeBf16Pack(
        k_nope_fp8=torch.randn(n, 448, generator=g).to(torch.float8_e4m3fn),
        k_rope_bf16=torch.randn(n, 64, generator=g).to(torch.bfloat16),
        scale_k_nope_ue8m0=torch.randint(0, 255, (n, 7), generator=g, dtype=torch.uint8),
    )


def _drive(pool: object, alloc: object, r2t: object) -> list[int]:
    """Prefill 300 tokens and store them in every layer through the pool's SWA store;
    returns the SWA pages written."""
    sched = rig.Scheduler(alloc, r2t)
    req = sched.prefill(300)
    full = r2t.req_to_token[req.kv.req_pool_idx, :300].long()  # type: ignore[attr-defined]
    swa_loc = alloc.translate_loc_from_full_to_swa(full)  # type: ignore[attr-defined]
    for layer in range(len(rig.RATIOS)):
        pool.set_swa_key_buffer(layer, swa_loc, _pack(300, seed=layer))  # type: ignore[attr-defined]
    return sorted({int(i) // rig.PAGE for i in swa_loc.tolist()})


def main() -> int:
    logging.disable(logging.WARNING)
    with rig.published():
        native = rig.make_pool()
        n_r2t = rig.make_req_to_token()
        n_alloc = rig.make_allocator(native, n_r2t)
        pages = _drive(native, n_alloc, n_r2t)

        pool = rig.make_pool()
        r2t = rig.make_req_to_token()
        alloc = rig.make_allocator(pool, r2t)
        backend = HostBackend(granularity=GRAN)
        bridge = attach(pool, Ledger(), allocator=alloc, backend=backend, env={ENV_ENABLE: "1"})
        assert bridge.active, bridge.reason
        assert _drive(pool, alloc, r2t) == pages
        store = bridge.store
        assert store is not None
        bases = store.pages.bases
        rows = [0, *pages]
        written = pool.swa_kv_pool.kv_buffer
        in_vmm = all(
            bases[i] <= t.data_ptr() < bases[i] + store.pages.reserved_bytes
            for i, t in enumerate(written)
        )
        vmm_views = [bridge.tensors[i].view(tuple(t.shape)) for i, t in enumerate(written)]
        equal = all(
            torch.equal(vmm_views[i][rows], native.swa_kv_pool.kv_buffer[i][rows])
            for i in range(len(written))
        )
        nonzero = sum(int(v[rows].count_nonzero()) for v in vmm_views)
        bridge.detach()
        back = pool.swa_kv_pool.kv_buffer
        detached_equal = all(
            torch.equal(back[i], native.swa_kv_pool.kv_buffer[i]) for i in range(len(back))
        )
        after = {**backend.stats(), "physical_bytes": backend.physical_bytes()}
        backend.close()
    print(
        json.dumps(
            {
                "pages": pages,
                "nonzero_bytes": nonzero,
                "in_vmm_reservation": in_vmm,
                "rows_equal_native": equal,
                "detached_rows_equal_native": detached_equal,
                "backend_after_detach": after,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
