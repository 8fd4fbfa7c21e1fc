"""Tensor geometry of SGLang 0.5.23's DeepSeek-V4 pools (default CUDA path; the V4 and V4.1
KV layouts, the V4.1 low-ratio layers).

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


# sglang/kernels/ops/attention/dsv4/kv_layout.py KVLayout: name -> (data bytes, scale bytes,
# page_align) per token. V4 (448 fp8 nope + 64 bf16 rope, 7 scales + 1 pad) is sized from
# the head dims by kv_entry_bytes; the V4.1 layouts quantize all 512 values: V41 fp8 with
# 16 ue8m0 scales (528 B), V41_FP4 e2m1 with 32 e4m3 scales (288 B). The _new layouts
# interleave each token's scales after its data and pad a page only to one token.
KV_LAYOUTS: dict[str, tuple[int, int, int]] = {
    "v4": (576, 8, V4_PAGE_ALIGN),
    "v41": (512, 16, 512),
    "v41_new": (512, 16, 528),
    "v41_fp4": (256, 32, 256),
    "v41_fp4_new": (256, 32, 288),
}
MAIN_KV_LAYOUTS = ("v4", "v41", "v41_new")  # DeepSeekV4TokenToKVPool's kv_layout (SWA cache)
COMPRESSED_KV_OPTIONS = ("auto", "fp8", "fp4")  # SGLANG_DSV4_COMPRESSED_KV_LAYOUT
LOW_RATIOS = (1, 2)  # V4.1 layers whose compressed cache a kv_source layer owns
# deepseek_v4_memory_pool.py dsv41_index_page_size: the low-ratio indexer page, 64 compressed
# slots (128 where DeepGEMM's paged sparse MQA logits kernel is present).
DEFAULT_LOW_RATIO_INDEX_PAGE = 64


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def layout_token_bytes(layout: str, qk_nope_head_dim: int = 448, qk_rope_head_dim: int = 64) -> int:
    """DeepSeekV4SingleKVPool.get_bytes_per_token: kv_entry_bytes for V4, else the layout's
    data + scale bytes (528 for v41 / v41_new, 288 for the fp4 ones)."""
    if layout == "v4":
        return kv_entry_bytes(qk_nope_head_dim, qk_rope_head_dim)
    data, scale, _ = KV_LAYOUTS[layout]
    return data + scale


def layout_page_bytes(layout: str, entries_per_page: int, entry_bytes: int) -> int:
    """KVLayout.page_bytes: the page's entries padded to the layout's page_align."""
    align = KV_LAYOUTS[layout][2]
    return ceil_div(entries_per_page * entry_bytes, align) * align


def compressed_layout(main: str, ratio: int, option: str = "auto") -> str:
    """deepseek_v4_memory_pool.py resolve_compressed_kv_layout: the layout of ratio's cache
    beside a `main` SWA cache. V4 pairs only with V4; beside V4.1 the low ratios (1, 2) are
    fp4 and ratios 4 / 128 fp8 unless `option` forces one, in main's arrangement."""
    if main == "v4":
        if option not in ("auto", "fp8"):
            raise ValueError(
                f"compressed_kv_layout={option!r} with kv_layout='v4', expected auto or fp8 "
                "(the V4 main cache pairs only with V4 caches)"
            )
        return "v4"
    fp4 = option == "fp4" or (option == "auto" and ratio in LOW_RATIOS)
    base = "v41_fp4" if fp4 else "v41"
    return base + "_new" if main == "v41_new" else base


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


def ring_size(ratio: int, speculative: bool, draft_tokens: int = 0) -> int:
    """deepseek_v4_memory_pool.py get_compress_state_ring_size (offline compression):
    c4 8 rows (16 with speculative decoding), c128 128 rows (256); the ratio-2 pair ring
    2 rows, or with speculative decoding the power of two above 1 + draft_tokens."""
    if ratio == 2:
        return 1 << (draft_tokens + 1).bit_length() if speculative else 2
    if ratio == 4:
        return 16 if speculative else 8
    if ratio == 128:
        return 256 if speculative else 128
    raise ValueError(f"ratio={ratio!r}, expected 2, 4 or 128")


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
