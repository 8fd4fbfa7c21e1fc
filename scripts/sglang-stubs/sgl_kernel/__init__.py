"""An import-only stand-in for SGLang's `sgl_kernel` (sglang-kernel) on machines without it.

On CUDA, SGLang 0.5.23's import chain reaches `sgl_kernel` (quantization,
sampling and attention modules import names from it at module level). The real
package is several hundred MB and built for another torch, so the device runs
carry this instead: it defines exactly the names SGLang 0.5.23's source imports
from `sgl_kernel` and its submodules (listed by an AST scan of the installed
package; tests/kvledger/test_sgl_kernel_stub.py checks the list still covers
it), each an `Unavailable` that raises NotImplementedError when called. What
kvledger runs of SGLang on CUDA (the DeepSeek-V4 pool, its Triton allocator,
Triton and JIT store kernels, CUDA graphs) calls none of them: a call means
that path needs the real kernels.
"""

from sgl_kernel._unavailable import define

STAND_IN = True
NAMES = (
    "apply_token_bitmask_inplace_cuda", "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu", "assign_req_to_token_pool_cpu", "awq_dequantize",
    "biased_topk", "build_draft_decode_metadata_cpu", "build_tree_kernel_efficient",
    "build_tree_kernel_efficient_cpu", "compress_norm_rope_store", "concat_mla_k",
    "copy_all_layer_kv_cache_cpu", "cutlass_w4a8_moe_mm", "es_fp8_blockwise_scaled_grouped_mm",
    "es_sm100_mxfp8_blockscaled_grouped_mm", "es_sm100_mxfp8_blockscaled_grouped_quant",
    "fast_topk_transform_fused", "fast_topk_transform_ragged_fused", "fast_topk_v2",
    "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu", "flash_compress128_decode",
    "flash_compress128_prefill", "flash_compress4_decode", "flash_compress4_prefill",
    "flash_mla_decode", "flash_mla_decode_get_workspace_size", "flash_mla_get_workspace_size",
    "flash_mla_prefill", "flash_mla_prefill_get_workspace_size", "flash_mla_sparse_fwd",
    "flash_mla_with_kvcache", "fp8_blockwise_scaled_grouped_mm", "fp8_mqa_logits",
    "fp8_paged_mqa_logits", "fp8_paged_mqa_logits_triton", "fp8_scaled_mm", "fused_add_rmsnorm",
    "fused_experts", "fused_hc_head", "fused_inplace_qknorm_rope", "fused_k_norm_rope_flashmla",
    "fused_q_indexer_rope_hadamard_quant", "fused_q_norm_rope",
    "fused_qk_rope_with_cos_sin_cache_inplace", "gdn_attention", "gelu_and_mul", "gelu_quick",
    "gelu_tanh_and_mul", "gemma_fused_add_rmsnorm", "gemma_rmsnorm",
    "get_cutlass_w4a8_moe_mm_data", "hadamard_transform", "hash_topk", "hc_post",
    "hc_split_sinkhorn", "infllmv2_attn_stage1", "int8_scaled_mm",
    "load_cache_to_device_buffer_dsv4_mla", "load_cache_to_device_buffer_mla",
    "max_pooling_1d_varlen", "merge_state_v2", "metal", "mhc_fused_post_pre", "mhc_pre",
    "min_p_sampling_from_probs", "minimax_decode_topk", "moe_fused_gate", "moe_sum",
    "moe_sum_reduce", "multimodal_rotary_embedding", "plan_compress_decode",
    "plan_compress_decode_legacy", "plan_compress_prefill", "plan_compress_prefill_legacy",
    "rmsnorm", "rotary_embedding", "rotate_input_ids_cpu", "sgl_per_tensor_quant_fp8",
    "sgl_per_token_quant_fp8", "shuffle_rows", "silu_and_mul", "silu_and_mul_clamp", "spatial",
    "store_cache_xpu", "top_k", "top_k_renorm_prob", "top_k_top_p_sampling_from_probs",
    "top_p_renorm_prob", "topk_sigmoid", "topk_softmax", "transfer_cache_dsv4_mla",
    "tree_speculative_sampling_target_only", "verify_tree_greedy", "verify_tree_greedy_cpu",
    "weak_ref_tensor",
)  # fmt: skip
define(globals(), __name__, NAMES)
del define
