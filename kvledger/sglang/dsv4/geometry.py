"""Tensor geometry of SGLang 0.5.23's DeepSeek-V4 pools (default CUDA path, V4 layout).

Each function names the SGLang 0.5.23 source it restates (paths under
sglang/srt/ unless noted). Formulas only; no SGLang code is imported.
"""

from __future__ import annotations

# sglang/kernels/ops/attention/dsv4/kv_layout.py (outside srt/), KVLayout.V4: 576 data bytes (448 fp8 nope
# + 64 bf16 rope) and 8 scale bytes (7 ue8m0 scales per 64 nope values + 1 pad) per
# token; a page's stride is padded to page_align = 576 bytes (the TMA row stride).
V4_PAGE_ALIGN = 576
V4_QUANT_TILE = 64  # KVLayout.V4.tile_size: nope values sharing one scale
V4_SCALE_PAD = 1  # DeepSeekV4SingleKVPool.scale_pad


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def kv_entry_bytes(qk_nope_head_dim: int, qk_rope_head_dim: int) -> int:
    """mem_cache/deepseek_v4_memory_pool.py DeepSeekV4SingleKVPool.get_bytes_per_token (V4):
    nope (fp8) + rope * 2 (bf16) + nope // 64 scales + 1 pad = 584 for 448/64."""
    return (
        qk_nope_head_dim + qk_rope_head_dim * 2 + qk_nope_head_dim // V4_QUANT_TILE + V4_SCALE_PAD
    )


def kv_page_bytes(entries_per_page: int, entry_bytes: int) -> int:
    """KVLayout.page_bytes: ceil(entries * 584 / 576) * 576 (the padded page stride)."""
    return ceil_div(entries_per_page * entry_bytes, V4_PAGE_ALIGN) * V4_PAGE_ALIGN


def physical_pages(size: int, page_size: int, global_page_size: int) -> int:
    """deepseek_v4_memory_pool.py _num_dsv4_physical_kv_pages: the paged allocator keeps
    one logical page (global_page_size tokens) reserved, so ceil((size + global) / page)."""
    return ceil_div(size + global_page_size, page_size)


def indexer_entry_bytes(index_head_dim: int, fp4: bool) -> int:
    """deepseek_v4_memory_pool.py get_dsv4_indexer_bytes_per_token: fp8 = dim + dim // 128 * 4
    (132 for 128); fp4 = dim // 2 + dim // 32 (68 for 128)."""
    if fp4:
        return index_head_dim // 2 + index_head_dim // 32
    return index_head_dim + index_head_dim // 128 * 4


def ring_size(ratio: int, speculative: bool) -> int:
    """deepseek_v4_memory_pool.py get_compress_state_ring_size (offline compression):
    c4 8 rows (16 with speculative decoding), c128 128 rows (256)."""
    if ratio == 4:
        return 16 if speculative else 8
    if ratio == 128:
        return 256 if speculative else 128
    raise ValueError(f"ratio={ratio!r}, expected 4 or 128")


def max_draft_tokens(ratio: int, ring: int) -> int:
    """deepseek_v4_memory_pool.py get_compress_state_write_pad: the draft tokens a ring
    serves, ring - window + 2 with window 8 for c4 and 128 for c128 (0 if ring <= window)."""
    window = ratio * (2 if ratio == 4 else 1)
    return ring - window + 2 if ring > window else 0


def state_rows(size: int, ring: int, ratio: int) -> int:
    """mem_cache/deepseek_v4_compress_state.py CompressStatePool.__init__ (offline):
    size + ring + 1 rows, rounded up to a multiple of the ratio."""
    return ceil_div(size + ring + 1, ratio) * ratio


def state_last_dim(head_dim: int, overlap: bool) -> int:
    """CompressStatePool: last_dim = 2 * (1 + overlap) * head_dim (kv and score halves);
    c4 overlaps (2048 for head 512, 512 for the 128-dim indexer), c128 does not (1024)."""
    return 2 * (1 + int(overlap)) * head_dim
