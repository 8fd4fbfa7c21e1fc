from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvledger.engines.sglang.dsv4 import ConfigError, Dsv4Shape, from_dict, load_config
from tests.kvledger.engines.sglang.dsv4.fixtures import FLASH_CONFIG, V41_CONFIG, flash_config_dict


def test_flash_config_layers() -> None:
    s = load_config(FLASH_CONFIG)
    assert s.num_hidden_layers == 43
    assert len(s.compress_ratios) == 44  # the trailing MTP entry
    assert s.mtp_ratios == (0,)
    assert len(s.layer_ratios) == 43
    assert s.layers(0) == (0, 1)
    assert len(s.layers(4)) == 21 and len(s.layers(128)) == 20
    assert s.layers(4) == tuple(range(2, 43, 2))
    assert s.layers(128) == tuple(range(3, 43, 2))
    assert (s.qk_nope_head_dim, s.qk_rope_head_dim, s.index_head_dim) == (448, 64, 128)
    assert s.sliding_window == 128
    # rope_scaling names original_max_position_embeddings: no factor (SGLang's rule).
    assert s.context_length == 8192


def test_v41_config_nested_text_config_and_sources() -> None:
    """The V4.1-shaped config keeps its text fields under text_config (as SGLang's
    normalize_deepseek_v41_config reads them) and names its kv_source layers."""
    s = load_config(V41_CONFIG)
    assert s.architecture == "DeepseekV41ForCausalLM" and s.has_low_ratios
    assert s.num_hidden_layers == 43 and s.mtp_ratios == (0,)
    assert len(s.layers(1)) == len(s.layers(2)) == 14
    assert s.sources(1) == (2, 8, 14, 20, 26, 32, 38)
    assert s.sources(2) == (4, 10, 16, 22, 28, 34, 40)
    assert s.owner_layers(1) == s.sources(1) and s.owner_layers(4) == s.layers(4)
    assert (s.qk_nope_head_dim, s.qk_rope_head_dim, s.index_head_dim) == (448, 64, 128)
    # to_config flattens it; reading that back gives the same shape.
    again = from_dict(s.to_config(), source=s.source)
    assert again == s
    # The top level wins over text_config, as in SGLang.
    d = json.loads(V41_CONFIG.read_text())
    d["sliding_window"] = 256
    assert from_dict(d).sliding_window == 256
    assert not load_config(FLASH_CONFIG).has_low_ratios


def test_with_ratios_picks_the_first_of_each_low_ratio_run() -> None:
    s = load_config(FLASH_CONFIG).with_ratios([0, 1, 1, 2, 2, 1, 4, 128])
    assert s.kv_source_layer_ids == (1, 3, 5)
    assert s.sources(1) == (1, 5) and s.sources(2) == (3,)
    t = s.with_ratios([0, 1, 1], kv_source_layer_ids=[1])
    assert t.sources(1) == (1,)


def test_context_length_rule() -> None:
    d = flash_config_dict()
    d["rope_scaling"] = {"type": "yarn", "factor": 4}
    assert from_dict(d).context_length == 4 * 8192
    d["max_seq_len"] = 1000
    assert from_dict(d).context_length == 4000
    del d["rope_scaling"], d["max_seq_len"], d["max_position_embeddings"]
    assert from_dict(d).context_length == 2048


def test_with_ratios_and_round_trip() -> None:
    s = from_dict(flash_config_dict())
    t = s.with_ratios([0, 4, 128])
    assert t.num_hidden_layers == 3 and t.layers(4) == (1,) and t.mtp_ratios == ()
    assert from_dict(s.to_config()).compress_ratios == s.compress_ratios
    assert isinstance(t, Dsv4Shape)


def _write(tmp_path: Path, data: object) -> Path:
    p = tmp_path / "config.json"
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=r"nope\.json.*no such file"):
        load_config(missing)


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_bad_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid JSON at line 1"):
        load_config(_write(tmp_path, '{"num_hidden_layers": 4,'))


def test_config_error_is_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, "architectures=.*DeepseekV4ForCausalLM"),
        ({"architectures": None}, "architectures=None"),
        ({"num_hidden_layers": 0}, "num_hidden_layers=0, expected an integer >= 1"),
        ({"num_hidden_layers": "43"}, "num_hidden_layers='43'"),
        ({"head_dim": None}, "head_dim=None"),
        ({"head_dim": 256}, "head_dim=256.*expected head_dim=512"),
        ({"index_head_dim": 100}, "index_head_dim=100, expected a multiple of 128"),
        ({"compress_ratios": []}, "compress_ratios=\\[\\]"),
        ({"compress_ratios": [0] * 10}, "has 10 entries, expected at least num_hidden_layers=43"),
        (
            {"compress_ratios": [0, 8] + [0] * 42},
            r"compress_ratios\[1\]=8, expected one of 0, 1, 2, 4, 128",
        ),
        (
            {"compress_ratios": [0, 2] + [0] * 42},
            r"layer 1 has compress ratio 2 but no kv_source layer of ratio 2 at or before it",
        ),
        (
            {"compress_ratios": [0, 0, 2, 1] + [0] * 40, "kv_source_layer_ids": [2, 4]},
            "layer 3 has compress ratio 1 but no kv_source layer of ratio 1",
        ),
        ({"kv_source_layer_ids": [43]}, r"kv_source_layer_ids=\[43\], expected a list of layer"),
        ({"kv_source_layer_ids": "2"}, "kv_source_layer_ids='2'"),
        ({"text_config": [1]}, "text_config is list, expected a JSON object"),
        ({"sliding_window": -1}, "sliding_window=-1"),
    ],
)
def test_not_dsv4_shaped(tmp_path: Path, change: dict[str, object], match: str) -> None:
    d = flash_config_dict()
    d.update(change)
    with pytest.raises(ConfigError, match=match) as info:
        load_config(_write(tmp_path, d))
    assert "config.json" in str(info.value)


def test_missing_field(tmp_path: Path) -> None:
    d = flash_config_dict()
    del d["index_head_dim"]
    with pytest.raises(ConfigError, match="field 'index_head_dim' is missing"):
        load_config(_write(tmp_path, d))


def test_top_level_not_object(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="top level is list"):
        load_config(_write(tmp_path, [1, 2]))
