"""The per-layer KV specs a decoder-only Hugging Face config declares to vLLM 0.33, built
with vLLM's own spec classes (`vllm/v1/kv_cache_interface.py`) for sizing before launch.

vLLM gets these from the model's attention layers (`get_kv_cache_spec`) once the model is
built; kvledger builds the same specs from the config for the shapes vLLM's standard
attention layer declares: full attention (`FullAttentionSpec`) and, where the config has
`sliding_window` (for every layer, or for the layers `layer_types` marks
`sliding_attention`), `SlidingWindowSpec`. KV heads are split over `tp` ranks (at least
one per rank), as vLLM's attention layer does. Other architectures (MLA, DeepSeek-V4's
compressed and indexer caches, Mamba state) are refused with one line naming the
architecture.
"""

from __future__ import annotations

from typing import Any

DTYPES = {
    "bfloat16": "bfloat16",
    "float16": "float16",
    "float32": "float32",
    "fp8": "float8_e4m3fn",
}
REFUSED = ("deepseek", "mamba", "jamba", "qwen3_next", "minimax")


class SpecError(ValueError):
    """The config cannot be turned into specs; the message is one line."""


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _int(hf: dict[str, Any], key: str, default: int | None = None) -> int:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(f"config {key}={value!r}, expected a positive int")
    return value


def decoder_specs(
    hf: dict[str, Any], *, block_size: int, tp: int = 1, kv_cache_dtype: str = "auto"
) -> dict[str, Any]:
    """layer name -> vLLM KVCacheSpec for one TP rank."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    model_type = str(hf.get("model_type", ""))
    if any(model_type.startswith(p) for p in REFUSED) or "kv_lora_rank" in hf:
        raise SpecError(
            f"config model_type={model_type!r}: kvledger builds specs for standard attention "
            "layers only (full and sliding window), expected a Llama-like decoder config"
        )
    layers = _int(hf, "num_hidden_layers")
    heads = _int(hf, "num_attention_heads")
    kv_heads = _int(hf, "num_key_value_heads", heads)
    hidden = _int(hf, "hidden_size")
    head_dim = _int(hf, "head_dim", hidden // heads)
    name = DTYPES.get(kv_cache_dtype) if kv_cache_dtype != "auto" else None
    if name is None:
        raw = str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16")
        name = DTYPES.get(raw)
        if name is None:
            raise SpecError(f"config torch_dtype={raw!r}, expected one of {', '.join(DTYPES)}")
    dtype = getattr(torch, name)
    per_rank = max(1, kv_heads // tp)
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != layers):
        raise SpecError(f"config layer_types: expected a list of {layers} entries")
    out: dict[str, Any] = {}
    for i in range(layers):
        sliding = (
            isinstance(window, int)
            and window > 0
            and (types is None or types[i] == "sliding_attention")
        )
        common = dict(block_size=block_size, num_kv_heads=per_rank, head_size=head_dim, dtype=dtype)
        out[layer_name(i)] = (
            SlidingWindowSpec(**common, sliding_window=window)
            if sliding
            else FullAttentionSpec(**common)
        )
    return out
