"""The serving knobs that change DeepSeek-V4 KV bytes in SGLang 0.5.23.

| knob | SGLang 0.5.23 spelling | what it changes |
|---|---|---|
| page_size | --page-size (forced 256 for paged SWA) | pages of every KV family |
| state_dtype | SGLANG_DSV4_COMPRESS_STATE_DTYPE (float32) | c4/c128 compressor state rows |
| indexer_dtype | --enable-deepseek-v4-fp4-indexer | c4 indexer entry: 132 B fp8, 68 B fp4 |
| speculative_draft_tokens | --speculative-num-draft-tokens (with an algorithm) | state rings 8->16 (c4) and 128->256 (c128); planner coefficient x (L+1)/L |
| max_running_requests | --max-running-requests | c128 state rows (one ring per request slot) |
| swa_full_tokens_ratio | --swa-full-tokens-ratio (DSV4 default 0.1) | SWA tokens = ratio x full tokens |
| context_length | --context-length (else from the config) | the planner's max_running_requests estimate |
| swa_sizing | "ratio", or "cap" (below) | how many SWA tokens there are |
| chunked_prefill_size | --chunked-prefill-size | cap mode: prefill chunks in flight |
| disable_overlap_schedule | --disable-overlap-schedule | cap mode: 1 chunk in flight instead of 2 |
| disable_radix_cache | --disable-radix-cache | cap mode: no cached prefix tails |
| swa_prefix_tails | --swa-prefix-tails (else 4 x max_running_requests) | cap mode: prefix tails kept |
| swa_eviction_interval | SGLANG_SWA_EVICTION_INTERVAL (128) | cap mode: tokens per request |
| kv_layout | SGLANG_DSV4_KV_LAYOUT (v4, v41, v41_new) | SWA entry 584 B (v4) or 528 B (V4.1), page padding |
| compressed_kv_layout | SGLANG_DSV4_COMPRESSED_KV_LAYOUT (auto, fp8, fp4) | V4.1 compressed caches: fp8 528 B or fp4 288 B |
| low_ratio_index_page | DeepGEMM's paged MQA logits present or not (64 / 128) | ratio-1/2 indexer pages |

kv_layout "auto" is what SGLang 0.5.23 picks on an SM100 / SM103 GPU: "v41" for a
config with V4.1 low-ratio layers (ratios 1 and 2), else "v4" (the V4.1 layouts
exist only there; elsewhere "auto" is V4, and a V4.1 model keeps V4 caches).

SWA sizing. "ratio": SWA tokens = swa_full_tokens_ratio x full tokens (what
SGLang 0.5.23 does when --swa-full-tokens-ratio is given, or when there is no
request cap or no chunked prefill). "cap": what it does when
--max-running-requests and a chunked prefill size are set and the ratio is not
(`DSV4PoolConfigurator._resolve_swa_cap_tokens`): the SWA pool is sized from
the request cap as fixed bytes, and the rest of the budget goes to full tokens.

Not modelled (each changes the layout or the sizing path): the unified-KV ring
(SGLANG_DSV4_UNIFIED_KV*), the trtllm backend, HiSparse, online c128
compression, encoder replay (the request-window SWA storage), the DSpark draft
ring, HIP's split fp4 indexer, pipeline / DP attention splits and PD
disaggregation. SWA cap mode is modelled without speculative decoding only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvledger.engines.sglang.dsv4.geometry import (
    COMPRESSED_KV_OPTIONS,
    DEFAULT_LOW_RATIO_INDEX_PAGE,
    MAIN_KV_LAYOUTS,
)

# name -> (torch dtype name, bytes per element)
STATE_DTYPES: dict[str, tuple[str, int]] = {"fp32": ("float32", 4), "bf16": ("bfloat16", 2)}
_STATE_ALIASES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}
INDEXER_DTYPES = ("fp8", "fp4")

DEFAULT_PAGE_SIZE = 256
DEFAULT_SWA_FULL_TOKENS_RATIO = 0.1  # SGLang 0.5.23 DSV4_DEFAULT_SWA_FULL_TOKENS_RATIO
DEFAULT_SWA_EVICTION_INTERVAL = 128  # SGLang 0.5.23 envs.SGLANG_SWA_EVICTION_INTERVAL
SWA_SIZINGS = ("ratio", "cap")
KV_LAYOUT_CHOICES = ("auto", *MAIN_KV_LAYOUTS)
LOW_RATIO_INDEX_PAGES = (64, 128)


@dataclass(frozen=True)
class Knobs:
    page_size: int = DEFAULT_PAGE_SIZE
    state_dtype: str = "fp32"
    indexer_dtype: str = "fp8"
    speculative_draft_tokens: int = 0
    max_running_requests: int | None = None
    swa_full_tokens_ratio: float = DEFAULT_SWA_FULL_TOKENS_RATIO
    context_length: int | None = None  # None: from the config, as SGLang does
    swa_sizing: str = "ratio"  # "ratio" or "cap"
    chunked_prefill_size: int | None = None
    disable_overlap_schedule: bool = False
    disable_radix_cache: bool = False
    swa_prefix_tails: int | None = None
    swa_eviction_interval: int = DEFAULT_SWA_EVICTION_INTERVAL
    kv_layout: str = "auto"  # "auto" (by the config: v41 with ratio-1/2 layers), v4, v41, v41_new
    compressed_kv_layout: str = "auto"  # V4.1 only: auto, fp8, fp4
    low_ratio_index_page: int = DEFAULT_LOW_RATIO_INDEX_PAGE

    def __post_init__(self) -> None:
        state = (
            _STATE_ALIASES.get(str(self.state_dtype).lower())
            if isinstance(self.state_dtype, str)
            else None
        )
        if state is None:
            raise ValueError(
                f"state_dtype={self.state_dtype!r}, expected one of fp32, bf16 "
                "(SGLANG_DSV4_COMPRESS_STATE_DTYPE)"
            )
        object.__setattr__(self, "state_dtype", state)
        if self.indexer_dtype not in INDEXER_DTYPES:
            raise ValueError(f"indexer_dtype={self.indexer_dtype!r}, expected one of fp8, fp4")
        _int(self, "page_size", 128)
        if self.page_size % 128:
            raise ValueError(
                f"page_size={self.page_size}, expected a multiple of 128 (SGLang 0.5.23 requires "
                "it for compressed attention and forces 256 for the paged SWA pool)"
            )
        _int(self, "speculative_draft_tokens", 0)
        if self.max_running_requests is not None:
            _int(self, "max_running_requests", 1)
        if self.context_length is not None:
            _int(self, "context_length", 1)
        r = self.swa_full_tokens_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
            raise ValueError(f"swa_full_tokens_ratio={r!r}, expected a number in (0, 1]")
        if self.swa_sizing not in SWA_SIZINGS:
            raise ValueError(f"swa_sizing={self.swa_sizing!r}, expected one of ratio, cap")
        if self.chunked_prefill_size is not None:
            _int(self, "chunked_prefill_size", 1)
        if self.swa_prefix_tails is not None:
            _int(self, "swa_prefix_tails", 0)
        _int(self, "swa_eviction_interval", 1)
        if self.kv_layout not in KV_LAYOUT_CHOICES:
            raise ValueError(
                f"kv_layout={self.kv_layout!r}, expected one of {', '.join(KV_LAYOUT_CHOICES)} "
                "(SGLANG_DSV4_KV_LAYOUT)"
            )
        if self.compressed_kv_layout not in COMPRESSED_KV_OPTIONS:
            raise ValueError(
                f"compressed_kv_layout={self.compressed_kv_layout!r}, expected one of "
                f"{', '.join(COMPRESSED_KV_OPTIONS)} (SGLANG_DSV4_COMPRESSED_KV_LAYOUT)"
            )
        if self.kv_layout == "v4" and self.compressed_kv_layout == "fp4":
            raise ValueError(
                "compressed_kv_layout='fp4' with kv_layout='v4': expected auto or fp8 (the V4 "
                "main cache pairs only with V4 caches)"
            )
        if self.low_ratio_index_page not in LOW_RATIO_INDEX_PAGES or isinstance(
            self.low_ratio_index_page, bool
        ):
            raise ValueError(
                f"low_ratio_index_page={self.low_ratio_index_page!r}, expected 64 or 128"
            )
        if self.swa_sizing == "cap":
            if self.max_running_requests is None or self.chunked_prefill_size is None:
                raise ValueError(
                    f"swa_sizing='cap' with max_running_requests={self.max_running_requests!r}, "
                    f"chunked_prefill_size={self.chunked_prefill_size!r}: expected both set "
                    "(SGLang 0.5.23 sizes SWA by the request cap only then)"
                )
            if self.speculative:
                raise ValueError(
                    f"swa_sizing='cap' with speculative_draft_tokens="
                    f"{self.speculative_draft_tokens}: expected 0 (cap mode with speculative "
                    "decoding is not modelled)"
                )

    @property
    def speculative(self) -> bool:
        return self.speculative_draft_tokens > 0

    @property
    def state_torch_dtype(self) -> str:
        return STATE_DTYPES[self.state_dtype][0]

    @property
    def state_element_size(self) -> int:
        return STATE_DTYPES[self.state_dtype][1]

    def resolved_kv_layout(self, has_low_ratios: bool) -> str:
        """The SWA cache layout: kv_layout, or for "auto" what SGLang 0.5.23 picks on an
        SM100 GPU for this model (v41 where the config has ratio-1/2 layers, else v4)."""
        if self.kv_layout != "auto":
            return self.kv_layout
        return "v41" if has_low_ratios else "v4"

    def replace(self, **changes: object) -> Knobs:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def _int(knobs: Knobs, name: str, minimum: int) -> None:
    value = getattr(knobs, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}, expected an integer >= {minimum}")
