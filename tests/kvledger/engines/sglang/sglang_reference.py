"""Builds SGLang 0.5.23's real DeepSeek-V4 pools and planner on the CPU; run in a subprocess.

    python -m tests.kvledger.engines.sglang.sglang_reference < cases.json > results.json

Each case is {"config": {...HF config...}, "knobs": {...kvledger Knobs fields...},
"context_length": N, and "budget_bytes" or "full_tokens"}; with "build": true the
pool is built from the sizes SGLang's own planner produced. The answer carries
those sizes (and the pool's tensors and mem_usage when built).
SGLang reads some knobs from the environment at import time
(SGLANG_DSV4_COMPRESS_STATE_DTYPE among them), so the caller starts one process
per environment. Only this file imports sglang; it is never imported by the
package under test.
"""

from __future__ import annotations

import contextlib
import json
import sys
import types
from typing import Any


@contextlib.contextmanager
def kv_layout(knobs: dict[str, Any]):
    """SGLang picks the KV layout from SGLANG_DSV4_KV_LAYOUT and the GPU (V4.1 only on SM100):
    pin `select_dsv4_kv_layout` to the case's resolved layout, as an SM100 host would give."""
    import sglang.srt.mem_cache.deepseek_v4_memory_pool as m

    option = knobs.get("compressed_kv_layout", "auto")
    chosen = (m.KVLayout(knobs.get("kv_layout", "v4")), None if option == "auto" else option)
    real = m.select_dsv4_kv_layout
    # The low-ratio indexer page: 128 where DeepGEMM's paged MQA logits kernel is present
    # (read at import as DSV41_INDEX_PAGE_SIZE, and at call time by the pool and planner).
    real_page = m.DSV41_INDEX_PAGE_SIZE
    m.select_dsv4_kv_layout = lambda: chosen
    m.DSV41_INDEX_PAGE_SIZE = knobs.get("low_ratio_index_page", real_page)
    try:
        yield chosen
    finally:
        m.select_dsv4_kv_layout = real
        m.DSV41_INDEX_PAGE_SIZE = real_page


@contextlib.contextmanager
def published(**server_args_fields: Any):
    """Publish a ServerArgs in SGLang's runtime context, as its own test fixtures do
    (sglang.test.test_utils.published_topology), and reset it afterwards."""
    from sglang.srt.runtime_context import reset_context

    server_args = publish_only(**server_args_fields)
    try:
        yield server_args
    finally:
        reset_context()


def publish_only(**server_args_fields: Any) -> Any:
    """Replace SGLang's runtime context with a ServerArgs of these fields (no reset after)."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path="dummy", **server_args_fields)
    reset_context()
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    return server_args


def _server_fields(knobs: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "page_size": knobs.get("page_size", 256),
        "swa_full_tokens_ratio": knobs.get("swa_full_tokens_ratio", 0.1),
        # Ratio sizing is what SGLang does with --swa-full-tokens-ratio on the command line;
        # cap sizing what it does without it (given a request cap and chunked prefill).
        "_swa_full_tokens_ratio_explicitly_set": knobs.get("swa_sizing", "ratio") == "ratio",
        "disable_radix_cache": knobs.get("disable_radix_cache", False),
        "disable_overlap_schedule": knobs.get("disable_overlap_schedule", False),
        "enable_deepseek_v4_fp4_indexer": knobs.get("indexer_dtype", "fp8") == "fp4",
    }
    if knobs.get("max_running_requests") is not None:
        fields["max_running_requests"] = knobs["max_running_requests"]
    if knobs.get("chunked_prefill_size") is not None:
        fields["chunked_prefill_size"] = knobs["chunked_prefill_size"]
    if knobs.get("swa_prefix_tails") is not None:
        fields["swa_prefix_tails"] = knobs["swa_prefix_tails"]
    if knobs.get("context_length") is not None:
        fields["context_length"] = knobs["context_length"]
    draft = knobs.get("speculative_draft_tokens", 0)
    if draft:
        fields.update(
            speculative_algorithm="EAGLE",
            speculative_num_draft_tokens=draft,
            speculative_num_steps=draft - 1 or 1,
            speculative_eagle_topk=1,
        )
    return fields


def _tensor(t: Any) -> dict[str, Any]:
    return {
        "shape": [int(s) for s in t.shape],
        "dtype": str(t.dtype).removeprefix("torch."),
        "tensor_bytes": int(t.numel() * t.element_size()),
        "storage_bytes": int(t.untyped_storage().nbytes()),
    }


def pool_tensors(pool: Any, ratios: list[int]) -> list[dict[str, Any]]:
    """Every tensor of a DeepSeekV4TokenToKVPool by family and global layer, read through
    the attributes SGLang 0.5.23 defines (explicit paths, not kvledger's inventory)."""
    stage = ratios[pool._stage_start : pool._stage_end]
    by_ratio = {r: [i for i, x in enumerate(stage) if x == r] for r in (4, 128)}
    for r in (1, 2):
        by_ratio[r] = list(pool.sources_by_ratio.get(r, []))
    out = []

    def add(family: str, layer: int, t: Any) -> None:
        out.append({"family": family, "layer": layer, **_tensor(t)})

    for i, t in enumerate(pool.swa_kv_pool.kv_buffer):
        add("swa_kv", i, t)
    for ratio in (4, 128, 1, 2):
        sub = pool.kv_pools.get(ratio)
        if sub is not None:
            for local, t in enumerate(sub.kv_buffer):
                add(f"c{ratio}_kv", by_ratio[ratio][local], t)
    for ratio in (4, 1, 2):
        idx = pool.index_pools.get(ratio)
        if idx is not None:
            for local, t in enumerate(idx.index_k_with_scale_buffer):
                add(f"c{ratio}_indexer", by_ratio[ratio][local], t)
    for layer, st in enumerate(pool.compress_state_pools):
        if st is not None:
            add(
                "c4_attn_state" if st.ratio == 4 else f"c{st.ratio}_state",
                layer,
                st.kv_score_buffer.kv_score,
            )
    for layer, st in enumerate(pool.indexer_compress_state_pools):
        if st is not None:
            add("c4_indexer_state", layer, st.kv_score_buffer.kv_score)
    return out


def build_pool(case: dict[str, Any], sizes: dict[str, Any]) -> dict[str, Any]:
    import torch
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.mem_cache.kv_cache_configurator import _get_dsv4_compress_state_dtypes

    cfg, knobs = case["config"], case["knobs"]
    ratios = list(cfg["compress_ratios"])
    layers = cfg["num_hidden_layers"]
    with published(**_server_fields(knobs)), kv_layout(knobs) as (layout, option):
        c4_dtype, c128_dtype = _get_dsv4_compress_state_dtypes()
        draft = knobs.get("speculative_draft_tokens", 0)
        pool = DeepSeekV4TokenToKVPool(
            max_num_reqs=sizes["max_running_requests"],
            num_req_slots=sizes["max_running_requests"] + 1,
            swa_size=sizes["swa_tokens"],
            c4_size=sizes["c4_tokens"],
            c128_size=sizes["c128_tokens"],
            c4_state_pool_size=sizes["c4_state_size"],
            c128_state_pool_size=sizes["c128_state_size"],
            page_size=knobs.get("page_size", 256),
            swa_page_size=knobs.get("page_size", 256),
            sliding_window=cfg["sliding_window"],
            dtype=torch.float8_e4m3fn,
            c4_state_dtype=c4_dtype,
            c128_state_dtype=c128_dtype,
            qk_nope_head_dim=cfg["head_dim"] - cfg["qk_rope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            indexer_head_dim=cfg["index_head_dim"],
            layer_num=layers,
            device="cpu",
            enable_memory_saver=False,
            compression_ratios=ratios,
            start_layer=0,
            end_layer=layers,
            online_mtp_max_draft_tokens=draft,
            full_size=sizes["full_tokens"],
            kv_source_layers=list(cfg.get("kv_source_layer_ids", [])),
            kv_layout=layout,
            compressed_kv_layout=option,
        )
        tensors = pool_tensors(pool, ratios)
        layouts = {"swa": pool.kv_layout.value} | {
            f"c{r}": sub.kv_layout.value for r, sub in pool.kv_pools.items() if sub is not None
        }
        mem_usage = float(pool.mem_usage)
        del pool
    return {"tensors": tensors, "mem_usage": mem_usage, "kv_layouts": layouts}


def run_planner(case: dict[str, Any]) -> dict[str, Any]:
    """SGLang 0.5.23's DSV4PoolConfigurator on a stand-in KVCacheConfigurator carrying the
    attributes its constructor reads."""
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor.pool_configurator import DSV4PoolConfigurator, MemoryPoolConfig
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    cfg, knobs = case["config"], case["knobs"]
    layers = cfg["num_hidden_layers"]
    draft = knobs.get("speculative_draft_tokens", 0)
    with published(**_server_fields(knobs)), kv_layout(knobs):
        hf = types.SimpleNamespace(**{"kv_source_layer_ids": [], **cfg})
        model_config = types.SimpleNamespace(
            qk_nope_head_dim=cfg["head_dim"] - cfg["qk_rope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            index_head_dim=cfg["index_head_dim"],
            compress_ratios=list(cfg["compress_ratios"]),
            window_size=cfg["sliding_window"],
            context_len=case["context_length"],
            hf_config=hf,
        )
        kvc = types.SimpleNamespace(
            kv_cache_dtype_str="fp8_e4m3",
            model_config=model_config,
            layer_info=types.SimpleNamespace(start_layer=0, end_layer=layers),
            pp_size=1,
            sliding_window_size=cfg["sliding_window"],
            page_size=knobs.get("page_size", 256),
            attn_dp_size=1,
            spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE" if draft else None),
            is_draft_worker=False,
            mambaish_config=None,
        )
        conf = DSV4PoolConfigurator(kvc)
        planning_mrr = None
        if "budget_bytes" in case:
            planning_mrr = conf._resolve_max_running_requests_per_worker(case["budget_bytes"])
            mpc = conf.calculate_pool_sizes(case["budget_bytes"], kvc.page_size)
        else:
            mpc = conf.calculate_pool_sizes_from_max_tokens(case["full_tokens"], kvc.page_size)
        assert isinstance(mpc, MemoryPoolConfig)
        # What the pools are built with: KVCacheConfigurator.resolve_max_num_reqs.
        mpc.max_running_requests = KVCacheConfigurator.resolve_max_num_reqs(
            kvc, mpc.full_max_total_num_tokens
        )
        mpc = conf.finalize_with_max_running_requests(mpc)
        return {
            "full_tokens": mpc.full_max_total_num_tokens,
            "swa_tokens": mpc.swa_max_total_num_tokens,
            "c4_tokens": mpc.c4_max_total_num_tokens,
            "c128_tokens": mpc.c128_max_total_num_tokens,
            "c4_state_size": mpc.c4_state_pool_size,
            "c128_state_size": mpc.c128_state_pool_size,
            "max_running_requests": mpc.max_running_requests,
            "bytes_per_full_token": conf.bytes_per_full_token,
            "bytes_per_swa_token": conf.bytes_per_swa_token,
            "swa_cap_tokens": conf.swa_cap_tokens,
            "planning_max_running_requests": planning_mrr,
            "c128_state_fixed_bytes": conf._get_c128_state_fixed_bytes(
                planning_mrr if planning_mrr is not None else mpc.max_running_requests
            ),
            "c2_state_fixed_bytes": conf._get_c2_state_fixed_bytes(
                planning_mrr if planning_mrr is not None else mpc.max_running_requests
            ),
        }


def main() -> int:
    import logging

    logging.disable(logging.WARNING)
    cases = json.load(sys.stdin)
    results = []
    for case in cases:
        try:
            sizes = run_planner(case)
            built = build_pool(case, sizes) if case.get("build") else {}
            results.append({"ok": True, "sizes": sizes, **built})
        except Exception as e:  # reported to the test, which fails with it
            results.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
