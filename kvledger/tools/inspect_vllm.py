"""`kvledger inspect-vllm`: the KV cache vLLM 0.33 would allocate per KV-cache group for a
Hugging Face config and a memory budget, computed by vLLM's own planner.

The per-layer specs come from the config (`kvledger.engines.vllm.specs`); vLLM's
`get_global_kv_cache_groups` and `get_kv_cache_configs`
(`vllm/v1/core/kv_cache_planning.py`) group the layers and size the one backing buffer,
exactly as the engine core does at start-up. Prints one row per group (kind, block size,
layers, bytes per token, bytes its layers address) and the buffer (blocks, bytes per
block, size). Needs vLLM importable (`scripts/test-vllm` builds such a venv); bad input
ends with one line (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

from accounting.units import format_size, parse_size
from kvledger.cli import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", metavar="CONFIG.json", help="a Hugging Face config.json (required)"
    )
    parser.add_argument(
        "--memory", metavar="BYTES", help="KV cache memory of one worker: 40GiB, 512MiB (required)"
    )
    parser.add_argument(
        "--block-size", metavar="N", default="16", help="vLLM's --block-size (default: %(default)s)"
    )
    parser.add_argument(
        "--max-model-len",
        metavar="N",
        default="4096",
        help="vLLM's --max-model-len (default: %(default)s)",
    )
    parser.add_argument(
        "--tensor-parallel-size", metavar="N", default="1", help="TP ranks (default: %(default)s)"
    )
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "float16", "fp8")
    )
    parser.add_argument(
        "--attention-backend",
        default="flashmla",
        choices=("flashmla", "flashinfer"),
        help="DeepSeek-V4 only: vLLM's NVIDIA attention backend whose KV layout to size "
        "(default: %(default)s, vLLM's choice on Hopper)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print a JSON document instead of the table"
    )


def _positive(value: str, flag: str) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n <= 0:
        raise UsageError(f"{flag} {value!r}: expected a positive integer")
    return n


def plan(args: argparse.Namespace) -> dict[str, Any]:
    if not args.config:
        raise UsageError("--config is missing, expected the path of a Hugging Face config.json")
    if not args.memory:
        raise UsageError("--memory is missing, expected the KV cache bytes of one worker (40GiB)")
    try:
        memory = parse_size(args.memory)
    except ValueError as e:
        raise UsageError(f"--memory: {e}") from None
    block = _positive(args.block_size, "--block-size")
    max_len = _positive(args.max_model_len, "--max-model-len")
    tp = _positive(args.tensor_parallel_size, "--tensor-parallel-size")
    try:
        with open(args.config, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"--config {args.config}: {e}") from None
    if not isinstance(hf, dict):
        raise UsageError(f"--config {args.config}: expected a JSON object")
    # vLLM logs to stdout by default; the table or the JSON document is what stdout is for.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        import vllm  # noqa: F401
    except Exception as e:
        raise UsageError(
            f"vLLM is not importable here ({type(e).__name__}: {e}); expected vLLM 0.33 "
            "(scripts/test-vllm builds a venv with it)"
        ) from None
    from kvledger.engines.vllm.dsv4_specs import deepseek_v4_specs, is_deepseek_v4
    from kvledger.engines.vllm.specs import SpecError, decoder_specs

    dsv4 = is_deepseek_v4(hf)
    specs: dict[str, Any] = {}
    layouts = ["LBNHC", "LBHNC"]  # what a GPU worker with FlashAttention reports first
    if not dsv4:
        try:
            specs = decoder_specs(hf, block_size=block, tp=tp, kv_cache_dtype=args.kv_cache_dtype)
        except SpecError as e:
            raise UsageError(str(e)) from None
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # planning needs a platform, not a GPU
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    with tempfile.TemporaryDirectory(prefix="kvledger-inspect-") as d:
        with open(os.path.join(d, "config.json"), "w", encoding="utf-8") as f:
            json.dump(hf, f)
        try:
            cfg = EngineArgs(
                model=d,
                skip_tokenizer_init=True,
                load_format="dummy",
                max_model_len=max_len,
                block_size=block,
                **({"kv_cache_dtype": args.kv_cache_dtype} if dsv4 else {}),
            ).create_engine_config()
            if dsv4:
                specs, layouts = deepseek_v4_specs(cfg, backend=args.attention_backend)
            resolve_kv_cache_layout(cfg, [layouts], list(specs.values()))
            groups = get_global_kv_cache_groups(cfg, [specs])
            config = get_kv_cache_configs(cfg, [specs], [memory], groups)[0]
        except ValueError as e:
            raise UsageError(str(e).splitlines()[0]) from None
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    doc = _document(config, specs, memory, layout=cfg.cache_config.get_resolved_kv_cache_layout())
    # vLLM's own "KV cache size: N tokens, maximum concurrency ..." line, from its function.
    tokens, concurrency = get_kv_cache_capacity(cfg, config)
    doc["vllm_kv_cache_size_tokens"] = tokens
    doc["vllm_max_concurrency"] = concurrency
    doc["max_model_len"] = cfg.model_config.max_model_len
    return doc


def _document(config: Any, specs: dict[str, Any], memory: int, *, layout: Any) -> dict[str, Any]:
    """What `plan` prints, from vLLM's KVCacheConfig and the per-layer specs it was
    planned from."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

    size = config.kv_cache_tensors[0].size if config.kv_cache_tensors else 0
    out_groups = []
    for i, g in enumerate(config.kv_cache_groups):
        spec = g.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: as planned
        page = sum((per_layer or specs)[n].page_size_bytes for n in g.layer_names)
        out_groups.append(
            {
                "group": i,
                "kind": get_kv_cache_spec_kind(spec).value,
                "block_size": spec.block_size,
                "layers": len(g.layer_names),
                "bytes_per_token": page // spec.block_size,
                "bytes_per_block": page,
                "addressed_bytes": page * config.num_blocks,
                "capacity_tokens": config.num_blocks * spec.block_size,
            }
        )
    return {
        "num_blocks": config.num_blocks,
        "bytes_per_block": size // config.num_blocks if config.num_blocks else 0,
        "buffer_bytes": size,
        "memory": memory,
        "kv_cache_layout": getattr(layout, "name", str(layout)),
        "groups": out_groups,
    }


def run(args: argparse.Namespace) -> int:
    doc = plan(args)
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        print()
        return 0
    print(
        f"{'group':>5}  {'kind':<22} {'block':>5} {'layers':>6} {'B/token':>10} {'addressed':>12} {'tokens':>10}"
    )
    for g in doc["groups"]:
        print(
            f"{g['group']:>5}  {g['kind']:<22} {g['block_size']:>5} {g['layers']:>6} "
            f"{g['bytes_per_token']:>10} {format_size(g['addressed_bytes']):>12} {g['capacity_tokens']:>10}"
        )
    print(
        f"buffer: {doc['num_blocks']} blocks of {format_size(doc['bytes_per_block'])} = "
        f"{format_size(doc['buffer_bytes'])} (one per worker; groups alias it)"
    )
    print(
        f"vLLM's KV cache size: {doc['vllm_kv_cache_size_tokens']:,} tokens, maximum "
        f"concurrency for {doc['max_model_len']:,} tokens per request: "
        f"{doc['vllm_max_concurrency']:.2f}x"
    )
    return 0
