"""kvledger's DeepSeek-V4 buffer map held against SGLang 0.5.23's real pools and planner.

Marked `sglang`: run through scripts/test-sglang, which builds .venv-sglang.
SGLang reads SGLANG_DSV4_COMPRESS_STATE_DTYPE (and others) at import time, so
every state dtype gets its own subprocess (tests/kvledger/engines/sglang/sglang_reference.py).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvledger.engines.sglang.dsv4 import Dsv4Shape, Knobs, plan
from tests.kvledger.engines.sglang.dsv4.fixtures import flash, v41

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).resolve().parents[5]
STATE_ENV = {"fp32": "float32", "bf16": "bfloat16"}
V41 = "v41"  # the V4.1-shaped config of kvledger/data (ratios 1 and 2 with kv_source layers)
Ratios = list[int] | str | None

# (id, layer ratios or None for Flash or V41, knobs, size)
POOL_CASES: list[tuple[str, Ratios, Knobs, dict[str, int]]] = [
    ("flash-16k-fp32", None, Knobs(max_running_requests=8), {"full_tokens": 16384}),
    (
        "flash-16k-bf16",
        None,
        Knobs(max_running_requests=8, state_dtype="bf16"),
        {"full_tokens": 16384},
    ),
    ("flash-1GiB-fp32", None, Knobs(max_running_requests=16), {"budget_bytes": 1 << 30}),
    (
        "flash-1GiB-bf16",
        None,
        Knobs(max_running_requests=16, state_dtype="bf16"),
        {"budget_bytes": 1 << 30},
    ),
    (
        "flash-fp4-indexer",
        None,
        Knobs(max_running_requests=4, indexer_dtype="fp4"),
        {"full_tokens": 40000},
    ),
    (
        "flash-mtp3",
        None,
        Knobs(max_running_requests=4, speculative_draft_tokens=3),
        {"full_tokens": 20480},
    ),
    (
        "mixed-small",
        [0, 4, 128, 4, 0, 128, 4],
        Knobs(max_running_requests=2),
        {"full_tokens": 7000},
    ),
    ("c4-only-bf16", [4, 4, 0, 4], Knobs(state_dtype="bf16"), {"full_tokens": 12288}),
    ("c128-only-auto-reqs", [128, 0, 0], Knobs(), {"full_tokens": 8192}),
    ("swa-only", [0, 0, 0, 0], Knobs(max_running_requests=3), {"budget_bytes": 64 << 20}),
    (
        "ratio-0.25",
        [0, 4, 128],
        Knobs(max_running_requests=5, swa_full_tokens_ratio=0.25),
        {"full_tokens": 4096},
    ),
    (
        "flash-cap-1GiB",
        None,
        Knobs(max_running_requests=4, swa_sizing="cap", chunked_prefill_size=2048),
        {"budget_bytes": 1 << 30},
    ),
    (
        "mixed-cap-no-radix-bf16",
        [0, 4, 128, 4],
        Knobs(
            max_running_requests=6,
            swa_sizing="cap",
            chunked_prefill_size=1024,
            disable_radix_cache=True,
            state_dtype="bf16",
        ),
        {"full_tokens": 30000},
    ),
    # DeepSeek-V4.1: the v41 / v41_new SWA layouts, the low-ratio (1, 2) layers.
    ("v41-16k-fp32", V41, Knobs(max_running_requests=8), {"full_tokens": 16384}),
    (
        "v41-1GiB-bf16",
        V41,
        Knobs(max_running_requests=16, state_dtype="bf16"),
        {"budget_bytes": 1 << 30},
    ),
    (
        "v41-mtp3-fp4-indexer",
        V41,
        Knobs(max_running_requests=4, speculative_draft_tokens=3, indexer_dtype="fp4"),
        {"full_tokens": 20480},
    ),
    (
        "v41-new-mixed",
        [0, 1, 1, 2, 2, 4, 128],
        Knobs(max_running_requests=2, kv_layout="v41_new"),
        {"full_tokens": 7000},
    ),
    (
        "v41-compressed-fp8",
        [0, 1, 2, 1, 2, 4, 128],
        Knobs(max_running_requests=3, compressed_kv_layout="fp8"),
        {"full_tokens": 9000},
    ),
    (
        "v41-compressed-fp4",
        [0, 4, 128, 1, 2],
        Knobs(max_running_requests=2, compressed_kv_layout="fp4"),
        {"full_tokens": 8192},
    ),
    ("v4-layout-low-ratios", [0, 1, 2, 4, 128], Knobs(kv_layout="v4"), {"full_tokens": 8192}),
    (
        "flash-in-v41-layout",
        None,
        Knobs(max_running_requests=4, kv_layout="v41"),
        {"full_tokens": 16384},
    ),
    (
        "v41-index-page-128",
        V41,
        Knobs(max_running_requests=8, low_ratio_index_page=128),
        {"full_tokens": 16384},
    ),
    (
        "v41-cap-1GiB",
        V41,
        Knobs(max_running_requests=4, swa_sizing="cap", chunked_prefill_size=2048),
        {"budget_bytes": 1 << 30},
    ),
]

PLANNER_CASES: list[tuple[str, Ratios, Knobs, dict[str, int]]] = [
    ("flash-80GiB-auto", None, Knobs(), {"budget_bytes": 80 << 30}),
    ("flash-80GiB-bf16-auto", None, Knobs(state_dtype="bf16"), {"budget_bytes": 80 << 30}),
    ("flash-60GiB-256req", None, Knobs(max_running_requests=256), {"budget_bytes": 60 << 30}),
    (
        "flash-7.5GiB-mtp",
        None,
        Knobs(max_running_requests=64, speculative_draft_tokens=4),
        {"budget_bytes": 7680 << 20},
    ),
    (
        "flash-50GiB-fp4-ctx",
        None,
        Knobs(indexer_dtype="fp4", context_length=65536),
        {"budget_bytes": 50 << 30},
    ),
    ("c128-6GiB-auto", [0, 128, 4, 128], Knobs(), {"budget_bytes": 6 << 30}),
    ("flash-tokens-1M", None, Knobs(max_running_requests=128), {"full_tokens": 1_000_000}),
    ("flash-odd-budget", None, Knobs(max_running_requests=100), {"budget_bytes": 12_345_678_901}),
    (
        "flash-cap-80GiB",
        None,
        Knobs(max_running_requests=256, swa_sizing="cap", chunked_prefill_size=8192),
        {"budget_bytes": 80 << 30},
    ),
    (
        "flash-cap-tails-no-overlap",
        None,
        Knobs(
            max_running_requests=64,
            swa_sizing="cap",
            chunked_prefill_size=16384,
            swa_prefix_tails=10,
            disable_overlap_schedule=True,
        ),
        {"budget_bytes": 20 << 30},
    ),
    (
        "flash-cap-tokens",
        None,
        Knobs(max_running_requests=32, swa_sizing="cap", chunked_prefill_size=4096),
        {"full_tokens": 2_000_000},
    ),
    ("v41-80GiB-auto", V41, Knobs(), {"budget_bytes": 80 << 30}),
    ("v41-60GiB-256req", V41, Knobs(max_running_requests=256), {"budget_bytes": 60 << 30}),
    (
        "v41-7.5GiB-mtp",
        V41,
        Knobs(max_running_requests=64, speculative_draft_tokens=4),
        {"budget_bytes": 7680 << 20},
    ),
    (
        "v41-new-odd-budget",
        V41,
        Knobs(max_running_requests=100, kv_layout="v41_new"),
        {"budget_bytes": 12_345_678_901},
    ),
    (
        "v41-compressed-fp8-20GiB",
        V41,
        Knobs(max_running_requests=32, compressed_kv_layout="fp8", state_dtype="bf16"),
        {"budget_bytes": 20 << 30},
    ),
    (
        "v41-cap-80GiB",
        V41,
        Knobs(max_running_requests=256, swa_sizing="cap", chunked_prefill_size=8192),
        {"budget_bytes": 80 << 30},
    ),
    ("v41-tokens-1M", V41, Knobs(max_running_requests=128), {"full_tokens": 1_000_000}),
    (
        "v41-index-page-128-30GiB",
        V41,
        Knobs(max_running_requests=64, low_ratio_index_page=128),
        {"budget_bytes": 30 << 30},
    ),
]


def _shape(ratios: Ratios) -> Dsv4Shape:
    if ratios == V41:
        return v41()
    s = flash()
    return s if ratios is None else s.with_ratios(ratios)  # type: ignore[arg-type]


def _case(ratios: Ratios, knobs: Knobs, size: dict[str, int], build: bool) -> dict[str, Any]:
    shape = _shape(ratios)
    return {
        "config": shape.to_config(),
        "knobs": {
            "page_size": knobs.page_size,
            "indexer_dtype": knobs.indexer_dtype,
            "speculative_draft_tokens": knobs.speculative_draft_tokens,
            "max_running_requests": knobs.max_running_requests,
            "swa_full_tokens_ratio": knobs.swa_full_tokens_ratio,
            "context_length": knobs.context_length,
            "swa_sizing": knobs.swa_sizing,
            "chunked_prefill_size": knobs.chunked_prefill_size,
            "disable_radix_cache": knobs.disable_radix_cache,
            "disable_overlap_schedule": knobs.disable_overlap_schedule,
            "swa_prefix_tails": knobs.swa_prefix_tails,
            "kv_layout": knobs.resolved_kv_layout(shape.has_low_ratios),
            "compressed_kv_layout": knobs.compressed_kv_layout,
            "low_ratio_index_page": knobs.low_ratio_index_page,
        },
        "context_length": knobs.context_length or shape.context_length,
        "build": build,
        **size,
    }


@functools.cache
def _reference(state_dtype: str, cases_json: str) -> tuple[dict[str, Any], ...]:
    env = {**os.environ, "SGLANG_DSV4_COMPRESS_STATE_DTYPE": STATE_ENV[state_dtype]}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kvledger.engines.sglang.sglang_reference"],
        input=cases_json,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        raise AssertionError(f"sglang_reference exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return tuple(json.loads(proc.stdout))


def _run(
    table: list[tuple[str, Ratios, Knobs, dict[str, int]]], build: bool
) -> dict[str, dict[str, Any]]:
    """All cases of one table, one subprocess per state dtype; results by case id."""
    out: dict[str, dict[str, Any]] = {}
    for dtype in STATE_ENV:
        rows = [c for c in table if c[2].state_dtype == dtype]
        if not rows:
            continue
        cases = [_case(r, k, s, build) for _, r, k, s in rows]
        results = _reference(dtype, json.dumps(cases))
        for (cid, *_), res in zip(rows, results, strict=True):
            out[cid] = res
    return out


@functools.cache
def _pool_results() -> dict[str, dict[str, Any]]:
    return _run(POOL_CASES, build=True)


@functools.cache
def _planner_results() -> dict[str, dict[str, Any]]:
    return _run(PLANNER_CASES, build=False)


def _sizes(bm: Any) -> dict[str, int]:
    s = bm.sizes
    return {
        "full_tokens": s.full_tokens,
        "swa_tokens": s.swa_tokens,
        "c4_tokens": s.c4_tokens,
        "c128_tokens": s.c128_tokens,
        "c4_state_size": s.c4_state_size,
        "c128_state_size": s.c128_state_size,
        "max_running_requests": s.max_running_requests,
    }


def _check_sizes(bm: Any, ref: dict[str, Any]) -> None:
    assert ref["ok"], ref.get("error")
    got = ref["sizes"]
    assert _sizes(bm) == {k: got[k] for k in _sizes(bm)}
    assert bm.pricing.bytes_per_full_token == pytest.approx(got["bytes_per_full_token"], rel=1e-12)
    assert bm.pricing.bytes_per_swa_token == pytest.approx(got["bytes_per_swa_token"], rel=1e-12)
    assert got["swa_cap_tokens"] == bm.pricing.swa_cap_tokens
    if bm.budget_bytes is not None:
        assert bm.planning_max_running_requests == got["planning_max_running_requests"]
    assert bm.planned_bytes("c128_state") == (
        got["c128_state_fixed_bytes"] if bm.shape.layers(128) else 0
    )
    c2 = bm.families.get("c2_state")
    assert (c2.planned_bytes if c2 else 0) == got["c2_state_fixed_bytes"]


@pytest.mark.parametrize("cid", [c[0] for c in POOL_CASES])
def test_buffer_map_equals_sglang_pool_tensor_for_tensor(cid: str) -> None:
    _, ratios, knobs, size = next(c for c in POOL_CASES if c[0] == cid)
    bm = plan(_shape(ratios), knobs, **size)
    ref = _pool_results()[cid]
    _check_sizes(bm, ref)
    ours = sorted((b.family, b.layer, list(b.shape), b.dtype, b.tensor_bytes) for b in bm.buffers)
    theirs = sorted(
        (t["family"], t["layer"], t["shape"], t["dtype"], t["tensor_bytes"]) for t in ref["tensors"]
    )
    assert ours == theirs
    for fam, fp in bm.families.items():
        assert fp.allocated_bytes == sum(
            t["tensor_bytes"] for t in ref["tensors"] if t["family"] == fam
        )
    # Each tensor owns its storage, exactly its tensor bytes.
    assert all(t["storage_bytes"] == t["tensor_bytes"] for t in ref["tensors"])
    assert ref["mem_usage"] == 0.0  # SGLang 0.5.23 reports nothing for this pool
    # The same families (V4.1's low-ratio ones included) and the same layout per cache.
    assert set(bm.families) == {t["family"] for t in ref["tensors"]} | {
        f for f, fp in bm.families.items() if not fp.layers
    }
    assert bm.to_dict()["kv_layouts"] == ref["kv_layouts"]


@pytest.mark.parametrize("cid", [c[0] for c in PLANNER_CASES])
def test_planner_equals_sglang_configurator(cid: str) -> None:
    _, ratios, knobs, size = next(c for c in PLANNER_CASES if c[0] == cid)
    bm = plan(_shape(ratios), knobs, **size)
    _check_sizes(bm, _planner_results()[cid])


def test_too_small_budget_is_refused_by_both() -> None:
    """With no request cap SGLang 0.5.23 plans 4096 requests' c128 state (43 GB in fp32 for
    Flash) before any token: a 30 GiB budget leaves no full token in either."""
    knobs = Knobs()
    case = _case(None, knobs, {"budget_bytes": 30 << 30}, build=False)
    (ref,) = _reference("fp32", json.dumps([case]))
    assert not ref["ok"]
    assert "cannot hold even one request" in ref["error"] or "Not enough memory" in ref["error"]
    with pytest.raises(ValueError, match="budget_bytes=32212254720 is too small"):
        plan(flash(), knobs, budget_bytes=30 << 30)
