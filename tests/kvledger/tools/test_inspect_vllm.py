"""`kvledger inspect-vllm`: vLLM's own planner on a config, and one-line errors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvledger.cli import main
from tests.kvledger.engines.vllm.vllm_setup import LLAMA


def _config(tmp_path, hf) -> str:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(hf))
    return str(p)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_it_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    rc = main(["inspect-vllm", "--config", _config(tmp_path, LLAMA), "--memory", "1GiB"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "vLLM is not importable" in err


def test_bad_input_is_one_line(tmp_path, capsys) -> None:
    assert main(["inspect-vllm", "--config", _config(tmp_path, LLAMA), "--memory", "lots"]) == 2
    assert main(["inspect-vllm", "--memory", "1GiB"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert "--memory" in err[0] and "--config is missing" in err[1]


@pytest.mark.vllm
def test_groups_of_a_hybrid_config_from_vllms_planner(tmp_path, capsys) -> None:
    hf = {**LLAMA, "sliding_window": 64, "layer_types": ["full_attention", "sliding_attention"] * 2}
    rc = main(
        [
            "inspect-vllm",
            "--config",
            _config(tmp_path, hf),
            "--memory",
            "64MiB",
            "--json",
            "--max-model-len",
            "1024",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    # vLLM's logger writes to stdout when vLLM was imported before (other tests, same process).
    doc = json.loads(out[out.index("{\n") :])
    kinds = sorted(g["kind"] for g in doc["groups"])
    assert kinds == ["full_attention", "sliding_window"]
    # K and V, 2 KV heads of 64 bf16 values, per layer and token.
    per_layer_token = 2 * 2 * 64 * 2
    for g in doc["groups"]:
        assert g["bytes_per_token"] == g["layers"] * per_layer_token
        assert g["addressed_bytes"] <= doc["buffer_bytes"]  # groups alias the buffer
    assert doc["buffer_bytes"] == doc["num_blocks"] * doc["bytes_per_block"] <= 64 << 20
    assert doc["num_blocks"] * doc["bytes_per_block"] > (64 << 20) - doc["bytes_per_block"]


def _dsv4_config() -> str:
    from importlib.resources import files

    return str(files("kvledger") / "data" / "deepseek-v4-flash-shape.config.json")


def _aligned(n: int, to: int) -> int:
    return -(-n // to) * to


@pytest.mark.vllm
def test_deepseek_v4_flash_five_groups_from_vllms_planner(capsys) -> None:
    """The five groups of vLLM #51041, from vLLM's planner on specs its own cache layer
    classes declare; the layer counts follow from the config, the page sizes from what
    vLLM's source says of the fp8_ds_mla layout."""
    rc = main(["inspect-vllm", "--config", _dsv4_config(), "--memory", "8GiB", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    hf = json.loads(Path(_dsv4_config()).read_text())
    ratios = hf["compress_ratios"][: hf["num_hidden_layers"]]
    n4, n128, layers = ratios.count(4), ratios.count(128), len(ratios)
    by_kind: dict[str, list[dict]] = {}
    for g in doc["groups"]:
        by_kind.setdefault(g["kind"], []).append(g)
    assert len(doc["groups"]) == 5
    swa = [g for g in by_kind["sliding_window_mla"] if g["block_size"] == 64]
    states = {g["block_size"]: g for g in by_kind["sliding_window_mla"] if g["block_size"] < 64}
    [mla] = by_kind["mla_attention"]
    assert sum(g["layers"] for g in swa) == layers  # one SWA cache per layer
    assert mla["layers"] == n4 + n128 + n4  # compressed caches, then the C4 indexers' K
    assert states[4]["layers"] == 2 * n4  # C4 attention and C4 indexer compressors
    assert states[8]["layers"] == n128  # C128 compressors
    assert doc["kv_cache_layout"] in ("BLHNC", "BLNHC")  # block-outermost: packed groups
    assert doc["buffer_bytes"] == doc["num_blocks"] * doc["bytes_per_block"] <= 8 << 30
    for g in doc["groups"]:
        assert g["bytes_per_block"] <= doc["bytes_per_block"]
        assert g["addressed_bytes"] == g["bytes_per_block"] * doc["num_blocks"]
    # Bytes per token differ by group (#51041: 4 to 92 KiB on one machine).
    assert len({g["bytes_per_token"] for g in doc["groups"]}) == 5
    # vLLM's own capacity figure (its "KV cache size: N tokens" line) for this plan.
    assert doc["vllm_kv_cache_size_tokens"] == int(doc["vllm_max_concurrency"] * 4096) > 0


@pytest.mark.vllm
def test_deepseek_v4_specs_match_what_vllms_source_says() -> None:
    from kvledger.engines.vllm.dsv4_specs import deepseek_v4_specs
    from tests.kvledger.engines.vllm import vllm_setup as vs

    hf = json.loads(Path(_dsv4_config()).read_text())
    cfg = vs.vllm_config(hf, max_model_len=4096, block_size=256)
    specs, layouts = deepseek_v4_specs(cfg)
    assert cfg.cache_config.cache_dtype == "fp8_ds_mla"  # vLLM's own resolution, written back
    # "448B NoPE + 128B RoPE + 8B fp8 scale = 584B per token", pages aligned to 576 B:
    swa = specs["model.layers.0.self_attn.swa_cache"]
    assert (swa.block_size, swa.page_size_bytes) == (64, _aligned(64 * 584, 576))
    c4 = specs["model.layers.2.self_attn"]  # "The KV block shape [256//4, head_dim] = [64, 584]"
    assert c4.page_size_bytes == _aligned(256 // 4 * 584, 576)
    c128 = specs["model.layers.3.self_attn"]
    assert c128.page_size_bytes == _aligned(256 // 128 * 584, 576)
    # "C4 compressor block shape [4, 2*512*2*4] -> block_size = 4", C128's [8, 512*2*4]
    s4 = specs["model.layers.2.self_attn.compressor.state_cache"]
    assert (s4.block_size, s4.page_size_bytes) == (4, _aligned(4 * 2 * 512 * 2 * 4, 576))
    s128 = specs["model.layers.3.self_attn.compressor.state_cache"]
    assert (s128.block_size, s128.page_size_bytes) == (8, _aligned(8 * 512 * 2 * 4, 576))
    # "FP8 indexer cache ... head_dim bytes = 128 fp8 + 4 fp32 scale = 132"
    k = specs["model.layers.2.self_attn.indexer.k_cache"]
    assert k.page_size_bytes == _aligned(256 // 4 * 132, 576)
    assert "model.layers.3.self_attn.indexer.k_cache" not in specs  # C128 layers: no indexer
    assert "model.layers.0.self_attn" not in specs  # SWA-only layers: no compressed cache
    assert layouts[0] in ("BLHNC", "BLNHC")


@pytest.mark.vllm
def test_deepseek_v4_on_flashinfers_layout(capsys) -> None:
    rc = main(
        [
            "inspect-vllm",
            "--config",
            _dsv4_config(),
            "--memory",
            "8GiB",
            "--json",
            "--attention-backend",
            "flashinfer",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    doc = json.loads(out)
    assert {g["kind"] for g in doc["groups"]} == {"sliding_window_mla", "mla_attention"}
