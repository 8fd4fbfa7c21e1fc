"""`kvledger inspect` run as a subprocess, for good and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from accounting import FIGURES
from kvledger.engines.sglang.dsv4 import FAMILIES, Knobs, load_config, plan
from kvledger.engines.sglang.dsv4.buffermap import LOW_RATIO_FAMILIES

ROOT = Path(__file__).resolve().parents[3]
FLASH = ROOT / "kvledger" / "data" / "deepseek-v4-flash-shape.config.json"
V41 = ROOT / "kvledger" / "data" / "deepseek-v41-shape.config.json"


def kvledger(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvledger", "inspect", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )


def test_table_for_budget() -> None:
    r = kvledger("--config", str(FLASH), "--budget", "80GiB", "--max-running-requests", "256")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "layers 43: 2 x SWA only, 21 x C4, 20 x C128" in out
    assert (
        "family" in out
        and "planned bytes" in out
        and "allocated bytes" in out
        and "overhead" in out
    )
    bm = plan(load_config(FLASH), Knobs(max_running_requests=256), budget_bytes=80 << 30)
    for family in FAMILIES:
        fp = bm.families[family]
        line = next(ln for ln in out.splitlines() if ln.startswith(family + " "))
        assert f"{fp.planned_bytes:,}" in line and f"{fp.allocated_bytes:,}" in line
        assert str(len(fp.layers)) in line.split()
        assert "x".join(map(str, fp.shape)) in line
    assert f"{bm.total_allocated_bytes:,}" in out


def test_json_document() -> None:
    r = kvledger(
        "--config", str(FLASH), "--full-tokens", "65536", "--state-dtype", "bf16", "--json"
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc["families"]) == set(FAMILIES)
    bm = plan(load_config(FLASH), Knobs(state_dtype="bf16"), full_tokens=65536)
    for family in FAMILIES:
        entry = doc["families"][family]
        for f in FIGURES:
            assert f.name in entry
        fp = bm.families[family]
        assert entry["tensor_bytes"] == fp.allocated_bytes == entry["allocated_bytes"]
        assert entry["reserved_bytes"] == entry["physical_bytes"] == fp.allocated_bytes
        assert entry["capacity_slots"] == fp.capacity_slots
        assert entry["planned_bytes"] == fp.planned_bytes
    assert doc["families"]["c128_state"]["dtype"] == "bfloat16"
    assert doc["totals"]["tensor_bytes"] == bm.total_allocated_bytes
    assert doc["sizes"]["full_tokens"] == 65536
    assert len(doc["buffers"]) == 167


def test_v41_config_is_detected_and_laid_out_in_v41() -> None:
    """A V4.1 config (ratios 1 and 2, kv_source_layer_ids) gets the V4.1 layouts without a
    flag, as SGLang picks them on SM100; its low-ratio families are rows of the table."""
    r = kvledger("--config", str(V41), "--budget", "80GiB", "--max-running-requests", "64")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("DeepSeek-V4.1 buffer map")
    assert "14 x C1 (7 kv_source), 14 x C2 (7 kv_source)" in out
    assert "KV layouts: swa v41, c1 v41_fp4, c2 v41_fp4, c4 v41, c128 v41" in out
    bm = plan(load_config(V41), Knobs(max_running_requests=64), budget_bytes=80 << 30)
    assert tuple(bm.families) == FAMILIES + LOW_RATIO_FAMILIES
    for family, fp in bm.families.items():
        line = next(ln for ln in out.splitlines() if ln.startswith(family + " "))
        assert f"{fp.planned_bytes:,}" in line and f"{fp.allocated_bytes:,}" in line
        assert "x".join(map(str, fp.shape)) in line
    assert bm.families["swa_kv"].shape[1] == 256 * 528


def test_kv_layout_flags_and_json() -> None:
    r = kvledger(
        "--config",
        str(V41),
        "--full-tokens",
        "65536",
        "--kv-layout",
        "v41_new",
        "--compressed-kv-layout",
        "fp8",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["knobs"]["kv_layout"] == "v41_new"
    assert doc["kv_layouts"] == {
        "swa": "v41_new",
        "c1": "v41_new",
        "c2": "v41_new",
        "c4": "v41_new",
        "c128": "v41_new",
    }
    assert set(doc["families"]) == set(FAMILIES + LOW_RATIO_FAMILIES)
    assert doc["families"]["c1_kv"]["slot_bytes"] == 528
    assert doc["kv_source_layer_ids"] == [2, 4, 8, 10, 14, 16, 20, 22, 26, 28, 32, 34, 38, 40]
    # A V4 config forced into v41: the same seven families, 528-byte SWA entries.
    r = kvledger("--config", str(FLASH), "--full-tokens", "65536", "--kv-layout", "v41", "--json")
    doc = json.loads(r.stdout)
    assert set(doc["families"]) == set(FAMILIES)
    assert doc["families"]["swa_kv"]["slot_bytes"] == 528
    # 128-slot indexer pages: (65536 + 256) slots of ratio 1 in 515 pages (one reserved).
    r = kvledger(
        "--config", str(V41), "--full-tokens", "65536", "--low-ratio-index-page", "128", "--json"
    )
    doc = json.loads(r.stdout)
    assert doc["families"]["c1_indexer"]["shape"] == [515, 128 * 68]
    # V4 forced on the V4.1 config: 584-byte entries everywhere.
    r = kvledger("--config", str(V41), "--full-tokens", "65536", "--kv-layout", "v4", "--json")
    doc = json.loads(r.stdout)
    assert doc["families"]["c2_kv"]["slot_bytes"] == 584


def test_cap_mode_flags() -> None:
    r = kvledger(
        "--config",
        str(FLASH),
        "--budget",
        "80GiB",
        "--max-running-requests",
        "256",
        "--swa-sizing",
        "cap",
        "--chunked-prefill-size",
        "8192",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["planner"]["swa_cap_tokens"] == doc["sizes"]["swa_tokens"] == 606_464
    r = kvledger("--config", str(FLASH), "--budget", "80GiB", "--swa-sizing", "cap")
    assert r.returncode == 2 and "--swa-sizing 'cap' with max_running_requests=None" in r.stderr


def test_size_units_and_knobs() -> None:
    r = kvledger(
        "--config",
        str(FLASH),
        "--budget",
        "2048MiB",
        "--max-running-requests",
        "8",
        "--indexer-dtype",
        "fp4",
        "--speculative-draft-tokens",
        "3",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["planner"]["budget_bytes"] == 2 << 30
    assert doc["families"]["c4_indexer"]["slot_bytes"] == 68
    assert doc["knobs"]["speculative_draft_tokens"] == 3


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["--config", "/nonexistent/config.json", "--budget", "1GiB"],
            "'/nonexistent/config.json': no such file",
        ),
        (["--budget", "1GiB"], "--config is missing"),
        (["--config", str(FLASH)], "expected exactly one of --budget BYTES or --full-tokens N"),
        (["--config", str(FLASH), "--budget", "80 furlongs"], "unknown unit 'furlongs'"),
        (["--config", str(FLASH), "--budget", "lots"], "size 'lots': expected a byte size"),
        (["--config", str(FLASH), "--budget", "0"], "--budget '0': expected a positive size"),
        (
            ["--config", str(FLASH), "--budget", "1MiB", "--max-running-requests", "4"],
            "--budget 1048576 is too small for one page per buffer",
        ),
        (
            ["--config", str(FLASH), "--full-tokens", "1GiB"],
            "--full-tokens '1GiB': expected an integer >= 1",
        ),
        (["--config", str(FLASH), "--full-tokens", "100"], "--full-tokens 100 gives 0 SWA tokens"),
        (
            ["--config", str(FLASH), "--budget", "1GiB", "--state-dtype", "fp16"],
            "argument --state-dtype: invalid choice: 'fp16'",
        ),
        (
            ["--config", str(FLASH), "--budget", "1GiB", "--indexer-dtype", "int4"],
            "argument --indexer-dtype: invalid choice: 'int4'",
        ),
        (
            ["--config", str(FLASH), "--budget", "1GiB", "--max-running-requests", "-3"],
            "--max-running-requests '-3': expected an integer >= 1",
        ),
        (
            ["--config", str(FLASH), "--budget", "1GiB", "--swa-full-tokens-ratio", "x"],
            "--swa-full-tokens-ratio 'x'",
        ),
        (
            ["--config", str(FLASH), "--budget", "10GiB", "--speculative-draft-tokens", "20"],
            "--speculative-draft-tokens 20, expected at most 10",
        ),
        (
            ["--config", str(FLASH), "--budget", "1GiB", "--kv-layout", "v5"],
            "argument --kv-layout: invalid choice: 'v5'",
        ),
        (
            [
                *("--config", str(V41), "--budget", "1GiB"),
                *("--kv-layout", "v4", "--compressed-kv-layout", "fp4"),
            ],
            "pairs only with V4 caches",
        ),
    ],
)
def test_bad_input_one_line_exit_2(args: list[str], needle: str) -> None:
    r = kvledger(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("kvledger inspect: ")
    assert needle in lines[0]
    assert r.stdout == ""


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "invalid JSON at line 1"),
        ('{"architectures": ["LlamaForCausalLM"]}', "not a DeepSeek-V4 config"),
        ("[]", "top level is list"),
    ],
)
def test_bad_config_files(tmp_path: Path, content: str, needle: str) -> None:
    p = tmp_path / "config.json"
    p.write_text(content)
    r = kvledger("--config", str(p), "--budget", "1GiB")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and str(p) in lines[0]


def test_python_m_kvledger_cli_also_exits_2() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvledger.cli", "inspect", "--config", str(FLASH), "--budget", "x"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_help_documents_every_option() -> None:
    r = kvledger("--help")
    assert r.returncode == 0, r.stderr
    assert "DeepSeek-V4 buffer map" in r.stdout
    import argparse

    from kvledger.tools import inspect

    parser = argparse.ArgumentParser()
    inspect.add_arguments(parser)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 20, action.option_strings
            assert action.option_strings[0] in r.stdout
    for flag, choices in (("--state-dtype", "fp32,bf16"), ("--indexer-dtype", "fp8,fp4")):
        assert f"{flag} {{{choices}}}" in r.stdout
