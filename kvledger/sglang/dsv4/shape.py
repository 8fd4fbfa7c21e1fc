"""The model shape DeepSeek-V4 KV sizing reads from a Hugging Face config.

Facts from SGLang 0.5.23:
- `ModelConfig` (sglang/srt/configs/model_config.py, DeepseekV4ForCausalLM
  branch) takes qk_rope_head_dim, qk_nope_head_dim = head_dim - qk_rope_head_dim,
  index_head_dim, window_size = sliding_window and compress_ratios as they are.
- `compress_ratios` carries one entry per layer plus one per MTP (next-n) layer.
  The target pool is built with start_layer=0, end_layer=num_hidden_layers
  (`KVCacheConfigurator._build_dsv4_kv_pool`), and `DeepSeekV4TokenToKVPool`
  slices `compression_ratios[start:end]`, so the trailing MTP entries own no
  buffer of the target pool. The MTP draft worker builds its own pool with
  ratio 0 (`COMPRESS_RATIO_NEXTN_LAYER`) for every layer; that pool is not
  part of this model.
- Ratios 1 and 2 (the V4.1 low-ratio layouts, with `kv_source_layer_ids`) are
  not modelled here and are refused.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

SUPPORTED_RATIOS = (0, 4, 128)
DSV4_ARCHITECTURES = ("DeepseekV4ForCausalLM",)
# The V4 FlashMLA layout (SGLang 0.5.23 `DeepSeekV4SingleKVPool.create_buffer`) asserts
# 448 fp8 nope + 64 bf16 rope values per token.
V4_NOPE_HEAD_DIM = 448
V4_ROPE_HEAD_DIM = 64


class ConfigError(ValueError):
    """A config that cannot be read, or is not shaped like DeepSeek-V4."""


@dataclass(frozen=True)
class Dsv4Shape:
    num_hidden_layers: int
    compress_ratios: tuple[int, ...]  # as in the config, MTP entries included
    head_dim: int
    qk_rope_head_dim: int
    index_head_dim: int
    sliding_window: int
    num_nextn_predict_layers: int = 0
    context_length: int = 2048  # SGLang's model_config.context_len, see _context_length
    source: str = "<memory>"

    @property
    def qk_nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def layer_ratios(self) -> tuple[int, ...]:
        """Ratios of the target model's layers (the MTP entries dropped)."""
        return self.compress_ratios[: self.num_hidden_layers]

    @property
    def mtp_ratios(self) -> tuple[int, ...]:
        return self.compress_ratios[self.num_hidden_layers :]

    def layers(self, ratio: int) -> tuple[int, ...]:
        """Layer ids (0-based) of the target model with compression `ratio`."""
        return tuple(i for i, r in enumerate(self.layer_ratios) if r == ratio)

    def with_ratios(self, ratios: list[int] | tuple[int, ...]) -> Dsv4Shape:
        """The same dims with another layer pattern (no MTP entries); validated."""
        d = self.to_config()
        d["num_hidden_layers"] = len(ratios)
        d["compress_ratios"] = list(ratios)
        return from_dict(d, source=f"{self.source} (ratios replaced)")

    def to_config(self) -> dict[str, Any]:
        """A minimal HF-style config dict with the fields this shape was read from."""
        d: dict[str, Any] = {
            "architectures": list(DSV4_ARCHITECTURES),
            "model_type": "deepseek_v4",
            "num_hidden_layers": self.num_hidden_layers,
            "compress_ratios": list(self.compress_ratios),
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "index_head_dim": self.index_head_dim,
            "sliding_window": self.sliding_window,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
        }
        d["max_position_embeddings"] = self.context_length
        return d


def load_config(path: str | os.PathLike[str]) -> Dsv4Shape:
    """Read a Hugging Face DeepSeek-V4 config.json. Raises ConfigError naming the problem."""
    p = os.fspath(path)
    try:
        with open(p, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(
            f"config {p!r}: no such file, expected a Hugging Face config.json"
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"config {p!r}: is a directory, expected a config.json file") from None
    except OSError as e:
        raise ConfigError(f"config {p!r}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config {p!r}: not UTF-8 text, expected JSON") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"config {p!r}: invalid JSON at line {e.lineno} column {e.colno} ({e.msg})"
        ) from None
    return from_dict(data, source=p)


def from_dict(data: Any, *, source: str = "<memory>") -> Dsv4Shape:
    if not isinstance(data, dict):
        raise ConfigError(
            f"config {source!r}: top level is {type(data).__name__}, expected a JSON object"
        )
    archs = data.get("architectures")
    if not isinstance(archs, list) or not any(a in DSV4_ARCHITECTURES for a in archs):
        raise ConfigError(
            f"config {source!r}: architectures={archs!r}, expected a list containing "
            f"{DSV4_ARCHITECTURES[0]!r} (not a DeepSeek-V4 config)"
        )

    def integer(name: str, *, minimum: int = 1, default: Any = ...) -> int:
        if name not in data:
            if default is not ...:
                return int(default)
            raise ConfigError(
                f"config {source!r}: field {name!r} is missing, expected an integer >= {minimum}"
            )
        value = data[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(
                f"config {source!r}: {name}={value!r}, expected an integer >= {minimum}"
            )
        return value

    layers = integer("num_hidden_layers")
    head_dim = integer("head_dim")
    rope = integer("qk_rope_head_dim")
    index_head_dim = integer("index_head_dim")
    window = integer("sliding_window")
    nextn = integer("num_nextn_predict_layers", minimum=0, default=0)
    context_length = _context_length(data, source)
    if (head_dim - rope, rope) != (V4_NOPE_HEAD_DIM, V4_ROPE_HEAD_DIM):
        raise ConfigError(
            f"config {source!r}: head_dim={head_dim}, qk_rope_head_dim={rope}, expected "
            f"head_dim={V4_NOPE_HEAD_DIM + V4_ROPE_HEAD_DIM} and qk_rope_head_dim="
            f"{V4_ROPE_HEAD_DIM} (the 584-byte V4 KV entry of SGLang 0.5.23)"
        )
    if index_head_dim % 128:
        raise ConfigError(
            f"config {source!r}: index_head_dim={index_head_dim}, expected a multiple of 128 "
            "(the indexer quantizes in blocks of 128)"
        )

    ratios = data.get("compress_ratios")
    if not isinstance(ratios, list) or not ratios:
        raise ConfigError(
            f"config {source!r}: compress_ratios={ratios!r}, expected a list with one "
            "compression ratio per layer (0, 4 or 128)"
        )
    for i, r in enumerate(ratios):
        if isinstance(r, bool) or r not in SUPPORTED_RATIOS:
            raise ConfigError(
                f"config {source!r}: compress_ratios[{i}]={r!r}, expected one of "
                f"{', '.join(map(str, SUPPORTED_RATIOS))}"
                + (" (ratios 1 and 2 are not modelled)" if r in (1, 2) else "")
            )
    if len(ratios) < layers:
        raise ConfigError(
            f"config {source!r}: compress_ratios has {len(ratios)} entries, expected at least "
            f"num_hidden_layers={layers} (one per layer, then one per MTP layer)"
        )
    return Dsv4Shape(
        num_hidden_layers=layers,
        compress_ratios=tuple(int(r) for r in ratios),
        head_dim=head_dim,
        qk_rope_head_dim=rope,
        index_head_dim=index_head_dim,
        sliding_window=window,
        num_nextn_predict_layers=nextn,
        context_length=context_length,
        source=source,
    )


_CONTEXT_LENGTH_KEYS = (
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
    "model_max_length",
    "max_position_embeddings",
)


def _context_length(data: dict[str, Any], source: str) -> int:
    """SGLang 0.5.23 `get_context_length` (srt/utils/hf_transformers/common.py): the first
    of these keys present, times rope_scaling.factor unless the scaling names
    original_max_position_embeddings or is llama3; 2048 when none is present."""
    factor: Any = 1
    scaling = data.get("rope_scaling")
    if isinstance(scaling, dict) and scaling:
        factor = scaling.get("factor", 1)
        if "original_max_position_embeddings" in scaling or scaling.get("rope_type") == "llama3":
            factor = 1
    for key in _CONTEXT_LENGTH_KEYS:
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1:
            raise ConfigError(f"config {source!r}: {key}={value!r}, expected an integer >= 1")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ConfigError(
                f"config {source!r}: rope_scaling.factor={factor!r}, expected a positive number"
            )
        return int(factor * value)
    return 2048
