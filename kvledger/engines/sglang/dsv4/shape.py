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
- DeepSeek-V4.1 (sglang/srt/configs/deepseek_v41.py): architectures
  `DeepseekV41ForCausalLM` (SGLang renames it DeepseekV4ForCausalLM), the text
  fields possibly nested under `text_config` (merged under the top level, as
  `normalize_deepseek_v41_config` does), and the low compression ratios 1 and 2,
  whose compressed cache only the `kv_source_layer_ids` layers own; the other
  ratio-1/2 layers read the nearest preceding source layer of their ratio
  (`DeepSeekV4TokenToKVPool.source_layer_of`, which asserts there is one).

`load_config` reads a user-named path with bounds: a regular file only, at most
`MAX_CONFIG_BYTES`; a device (`/dev/zero`), a FIFO, a socket or a directory is
refused from its `stat` before it is opened, the opened file must be the one
that was looked at (same device and inode), and no more than
`MAX_CONFIG_BYTES` + 1 bytes are read: a hostile path can neither hang the
command nor fill its memory.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from typing import Any

SUPPORTED_RATIOS = (0, 1, 2, 4, 128)
LOW_RATIOS = (1, 2)
DSV4_ARCHITECTURES = ("DeepseekV4ForCausalLM", "DeepseekV41ForCausalLM")
# A Hugging Face config.json is a few KiB; a DeepSeek-V4 one with its quantization block ~4 KiB.
MAX_CONFIG_BYTES = 1 << 20
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
    kv_source_layer_ids: tuple[int, ...] = ()  # V4.1: layers owning a ratio-1/2 cache
    architecture: str = DSV4_ARCHITECTURES[0]
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

    @property
    def has_low_ratios(self) -> bool:
        """A V4.1 config: some layer has compression ratio 1 or 2."""
        return any(r in LOW_RATIOS for r in self.layer_ratios)

    def sources(self, ratio: int) -> tuple[int, ...]:
        """The kv_source layers of a low `ratio` (1 or 2): the layers owning its cache."""
        return tuple(i for i in self.kv_source_layer_ids if self.layer_ratios[i] == ratio)

    def owner_layers(self, ratio: int) -> tuple[int, ...]:
        """Layers owning compressed storage of `ratio` (SGLang 0.5.23
        `collect_sources_by_ratio`): every layer of ratio 4 / 128, the sources of 1 / 2."""
        return self.sources(ratio) if ratio in LOW_RATIOS else self.layers(ratio)

    def with_ratios(
        self,
        ratios: list[int] | tuple[int, ...],
        kv_source_layer_ids: list[int] | tuple[int, ...] | None = None,
    ) -> Dsv4Shape:
        """The same dims with another layer pattern (no MTP entries); validated. Without
        `kv_source_layer_ids`, the first layer of each run of equal low ratios is the source."""
        d = self.to_config()
        d["num_hidden_layers"] = len(ratios)
        d["compress_ratios"] = list(ratios)
        if kv_source_layer_ids is None:
            kv_source_layer_ids = [
                i
                for i, r in enumerate(ratios)
                if r in LOW_RATIOS and (i == 0 or ratios[i - 1] != r)
            ]
        d["kv_source_layer_ids"] = list(kv_source_layer_ids)
        return from_dict(d, source=f"{self.source} (ratios replaced)")

    def to_config(self) -> dict[str, Any]:
        """A minimal HF-style config dict with the fields this shape was read from."""
        v41 = self.architecture == DSV4_ARCHITECTURES[1]
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": "deepseek_v41" if v41 else "deepseek_v4",
            "num_hidden_layers": self.num_hidden_layers,
            "compress_ratios": list(self.compress_ratios),
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "index_head_dim": self.index_head_dim,
            "sliding_window": self.sliding_window,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
        }
        if self.kv_source_layer_ids:
            d["kv_source_layer_ids"] = list(self.kv_source_layer_ids)
        d["max_position_embeddings"] = self.context_length
        return d


def load_config(path: str | os.PathLike[str]) -> Dsv4Shape:
    """Read a Hugging Face DeepSeek-V4 / V4.1 config.json, with bounds (module docstring).
    Raises ConfigError naming the path and what was expected."""
    p = os.fspath(path)
    data = _read_bounded(p)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"config {p!r}: not UTF-8 text, expected JSON") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"config {p!r}: invalid JSON at line {e.lineno} column {e.colno} ({e.msg})"
        ) from None
    return from_dict(value, source=p)


def _refuse_kind(p: str, st: os.stat_result) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"config {p!r}: is a directory, expected a config.json file")
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(
            f"config {p!r}: not a regular file (a device, FIFO or socket), expected a "
            "config.json file"
        )
    if st.st_size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config {p!r}: {st.st_size} bytes, expected a config.json of at most "
            f"{MAX_CONFIG_BYTES} bytes"
        )


def _read_bounded(p: str) -> bytes:
    try:
        before = os.stat(p)
    except FileNotFoundError:
        raise ConfigError(
            f"config {p!r}: no such file, expected a Hugging Face config.json"
        ) from None
    except OSError as e:
        raise ConfigError(f"config {p!r}: cannot read it ({e.strerror})") from None
    _refuse_kind(p, before)
    try:
        # O_NONBLOCK: a FIFO swapped in after the stat opens at once instead of waiting for a writer.
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"config {p!r}: cannot read it ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        _refuse_kind(p, st)
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise ConfigError(f"config {p!r}: replaced while being opened, expected a stable file")
        try:
            data = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise ConfigError(f"config {p!r}: cannot read it ({e.strerror})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config {p!r}: more than {MAX_CONFIG_BYTES} bytes, expected a config.json of at "
            f"most {MAX_CONFIG_BYTES} bytes"
        )
    return data


def from_dict(data: Any, *, source: str = "<memory>") -> Dsv4Shape:
    if not isinstance(data, dict):
        raise ConfigError(
            f"config {source!r}: top level is {type(data).__name__}, expected a JSON object"
        )
    text = data.get("text_config")
    if text is not None:
        if not isinstance(text, dict):
            raise ConfigError(
                f"config {source!r}: text_config is {type(text).__name__}, expected a JSON object"
            )
        # SGLang's normalize_deepseek_v41_config: the text fields, the top level winning.
        data = {**text, **{k: v for k, v in data.items() if k != "text_config"}}
    archs = data.get("architectures")
    if not isinstance(archs, list) or not any(a in DSV4_ARCHITECTURES for a in archs):
        raise ConfigError(
            f"config {source!r}: architectures={archs!r}, expected a list containing "
            f"{DSV4_ARCHITECTURES[0]!r} or {DSV4_ARCHITECTURES[1]!r} (not a DeepSeek-V4 config)"
        )
    architecture = next(a for a in archs if a in DSV4_ARCHITECTURES)

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
            "compression ratio per layer (0, 1, 2, 4 or 128)"
        )
    for i, r in enumerate(ratios):
        if isinstance(r, bool) or r not in SUPPORTED_RATIOS:
            raise ConfigError(
                f"config {source!r}: compress_ratios[{i}]={r!r}, expected one of "
                f"{', '.join(map(str, SUPPORTED_RATIOS))}"
            )
    if len(ratios) < layers:
        raise ConfigError(
            f"config {source!r}: compress_ratios has {len(ratios)} entries, expected at least "
            f"num_hidden_layers={layers} (one per layer, then one per MTP layer)"
        )
    sources = _kv_sources(data, ratios[:layers], source)
    return Dsv4Shape(
        num_hidden_layers=layers,
        compress_ratios=tuple(int(r) for r in ratios),
        head_dim=head_dim,
        qk_rope_head_dim=rope,
        index_head_dim=index_head_dim,
        sliding_window=window,
        num_nextn_predict_layers=nextn,
        context_length=context_length,
        kv_source_layer_ids=sources,
        architecture=architecture,
        source=source,
    )


def _kv_sources(data: dict[str, Any], ratios: list[int], source: str) -> tuple[int, ...]:
    """kv_source_layer_ids, checked: layer ids of this model, and every ratio-1/2 layer
    preceded (or itself) by a source of its ratio, which SGLang 0.5.23 asserts."""
    raw = data.get("kv_source_layer_ids", [])
    if raw is None:
        raw = []
    if not isinstance(raw, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(ratios) for i in raw
    ):
        raise ConfigError(
            f"config {source!r}: kv_source_layer_ids={raw!r}, expected a list of layer ids "
            f"in [0, {len(ratios)})"
        )
    ids = tuple(sorted(set(raw)))
    for i, r in enumerate(ratios):
        if r in LOW_RATIOS and not any(j <= i and ratios[j] == r for j in ids):
            raise ConfigError(
                f"config {source!r}: layer {i} has compress ratio {r} but no kv_source layer "
                f"of ratio {r} at or before it, expected kv_source_layer_ids to name one "
                f"(kv_source_layer_ids={list(ids)!r})"
            )
    return ids


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
