"""`kvledger inspect-vllm`: vLLM's own planner on a config, and one-line errors."""

from __future__ import annotations

import importlib.util
import json

import pytest

from kvledger.cli import main
from tests.kvledger.vllm.vllm_setup import LLAMA


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


@pytest.mark.vllm
def test_deepseek_v4_is_refused_with_one_line(tmp_path, capsys) -> None:
    from importlib.resources import files

    cfg = str(files("kvledger") / "data" / "deepseek-v4-flash-shape.config.json")
    assert main(["inspect-vllm", "--config", cfg, "--memory", "1GiB"]) == 2
    assert "model_type='deepseek_v4'" in capsys.readouterr().err
