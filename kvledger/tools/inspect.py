"""`kvledger inspect`: the DeepSeek-V4 buffer map (V4.1 included) for a config and a size, as SGLang 0.5.23 lays it out.

A V4.1 config (compress ratios 1 and 2 with kv_source_layer_ids) is detected from the
config and laid out in the V4.1 KV layouts (--kv-layout auto; v4, v41 or v41_new force one).
Prints one row per buffer family: buffers, shape of one layer's buffer, dtype,
the planner's predicted bytes, the bytes really allocated, and the overhead.
With --json, a document whose `families` carry every figure of
accounting.figures (tensor_bytes, reserved_bytes, physical_bytes,
capacity_slots, ...) under the family names of
docs/background.md#deepseek-v4-geometry, beside planned and allocated bytes.
Bad input ends with one line naming the value and what was expected (exit
status 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from accounting import FIGURES, Ledger
from accounting.units import format_size, parse_size
from kvledger.cli import UsageError
from kvledger.engines.sglang.dsv4 import BufferMap, ConfigError, Knobs, load_config, plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "example: kvledger inspect --config config.json --budget 80GiB "
        "--max-running-requests 64 (docs/sglang.md explains the table)"
    )
    # Numbers are checked in build() (one line naming the flag and the expected range).
    parser.add_argument(
        "--config",
        metavar="CONFIG.json",
        help="a Hugging Face DeepSeek-V4 or V4.1 config.json (required); the fields SGLang reads "
        "for KV sizing: layer count, compress_ratios, kv_source_layer_ids, head and indexer dims, "
        "sliding_window",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--budget",
        metavar="BYTES",
        help="the KV byte budget SGLang's planner sizes the pools from, with units: 80GiB, "
        "512MiB, 1.5GB, 4096 (this or --full-tokens)",
    )
    size.add_argument(
        "--full-tokens",
        metavar="N",
        help="size the pools for N full-pool tokens instead of a budget",
    )
    parser.add_argument(
        "--state-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="compressor state dtype, SGLang's SGLANG_DSV4_COMPRESS_STATE_DTYPE "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--indexer-dtype",
        choices=("fp8", "fp4"),
        default="fp8",
        help="C4 indexer entries: 132 B (fp8) or 68 B (fp4, SGLang's "
        "--enable-deepseek-v4-fp4-indexer) (default: %(default)s)",
    )
    parser.add_argument(
        "--max-running-requests",
        metavar="N",
        help="SGLang's --max-running-requests: one c128 state ring per request slot (default: "
        "what SGLang plans from the budget and context length, 2048 to 4096)",
    )
    parser.add_argument(
        "--speculative-draft-tokens",
        metavar="N",
        default="0",
        help="SGLang's --speculative-num-draft-tokens; non-zero doubles the state rings "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--swa-full-tokens-ratio",
        metavar="R",
        default="0.1",
        help="SWA tokens per full token, in (0, 1] (default: %(default)s, SGLang's for DSV4)",
    )
    parser.add_argument(
        "--context-length",
        metavar="N",
        help="SGLang's --context-length, used to plan the request count (default: the config's)",
    )
    parser.add_argument(
        "--swa-sizing",
        choices=("ratio", "cap"),
        default="ratio",
        help="size the SWA pool by --swa-full-tokens-ratio, or from the request cap as SGLang "
        "does with --max-running-requests and --chunked-prefill-size (default: %(default)s)",
    )
    parser.add_argument(
        "--chunked-prefill-size",
        metavar="N",
        help="cap mode: SGLang's --chunked-prefill-size (needed with --swa-sizing cap)",
    )
    parser.add_argument(
        "--swa-prefix-tails",
        metavar="N",
        help="cap mode: cached prefix tails the SWA pool keeps (default: 4 x requests, 0 with "
        "--disable-radix-cache)",
    )
    parser.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="cap mode: SGLang's --disable-radix-cache (no prefix tails kept)",
    )
    parser.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="cap mode: SGLang's --disable-overlap-schedule (1 prefill chunk in flight, not 2)",
    )
    parser.add_argument(
        "--kv-layout",
        choices=("auto", "v4", "v41", "v41_new"),
        default="auto",
        help="the SWA KV layout, SGLang's SGLANG_DSV4_KV_LAYOUT: 584-byte V4 entries or 528-byte "
        "V4.1 ones; auto is what SGLang picks on an SM100 GPU: v41 for a V4.1 config (ratio 1/2 "
        "layers), else v4 (default: %(default)s)",
    )
    parser.add_argument(
        "--compressed-kv-layout",
        choices=("auto", "fp8", "fp4"),
        default="auto",
        help="V4.1 compressed caches, SGLang's SGLANG_DSV4_COMPRESSED_KV_LAYOUT: auto keeps "
        "ratios 1 and 2 in fp4 (288 B) and 4 and 128 in fp8 (528 B) (default: %(default)s)",
    )
    parser.add_argument(
        "--low-ratio-index-page",
        choices=("64", "128"),
        default="64",
        help="V4.1 ratio-1/2 indexer page in slots: 64, or 128 where DeepGEMM's paged MQA "
        "logits kernel is installed (SGLang's DSV41_INDEX_PAGE_SIZE) (default: %(default)s)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print a JSON document with every figure and buffer"
    )


def run(args: argparse.Namespace) -> int:
    bm = build(args)
    if args.json:
        json.dump(document(bm), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(table(bm))
    return 0


def build(args: argparse.Namespace) -> BufferMap:
    if not args.config:
        raise UsageError("--config is missing, expected the path of a DeepSeek-V4 config.json")
    if (args.budget is None) == (args.full_tokens is None):
        raise UsageError("expected exactly one of --budget BYTES or --full-tokens N")
    try:
        knobs = Knobs(
            state_dtype=args.state_dtype,
            indexer_dtype=args.indexer_dtype,
            max_running_requests=_int(args.max_running_requests, "--max-running-requests", 1),
            speculative_draft_tokens=_int(
                args.speculative_draft_tokens, "--speculative-draft-tokens", 0
            )
            or 0,
            swa_full_tokens_ratio=_float(args.swa_full_tokens_ratio, "--swa-full-tokens-ratio"),
            context_length=_int(args.context_length, "--context-length", 1),
            swa_sizing=args.swa_sizing,
            chunked_prefill_size=_int(args.chunked_prefill_size, "--chunked-prefill-size", 1),
            swa_prefix_tails=_int(args.swa_prefix_tails, "--swa-prefix-tails", 0),
            disable_radix_cache=args.disable_radix_cache,
            disable_overlap_schedule=args.disable_overlap_schedule,
            kv_layout=args.kv_layout,
            compressed_kv_layout=args.compressed_kv_layout,
            low_ratio_index_page=int(args.low_ratio_index_page),
        )
    except ValueError as e:
        raise UsageError(_flag_names(str(e))) from None
    try:
        shape = load_config(args.config)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    try:
        if args.budget is not None:
            if args.budget.strip().startswith("-"):
                raise UsageError(f"--budget {args.budget!r}: negative, expected a positive size")
            try:
                budget = parse_size(args.budget)
            except ValueError as e:
                raise UsageError(f"--budget: {e}") from None
            if budget <= 0:
                raise UsageError(f"--budget {args.budget!r}: expected a positive size")
            return plan(shape, knobs, budget_bytes=budget)
        tokens = _int(args.full_tokens, "--full-tokens", 1)
        return plan(shape, knobs, full_tokens=tokens)
    except ValueError as e:
        raise UsageError(_flag_names(str(e))) from None


def _int(text: str | None, flag: str, minimum: int) -> int | None:
    if text is None:
        return None
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected an integer >= {minimum}") from None
    if value < minimum:
        raise UsageError(f"{flag} {text!r}: expected an integer >= {minimum}")
    return value


def _float(text: str, flag: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected a number in (0, 1]") from None


def _flag_names(message: str) -> str:
    """Knobs and plan name their fields (state_dtype=...); say the flag instead."""
    for field in (
        "state_dtype",
        "indexer_dtype",
        "max_running_requests",
        "speculative_draft_tokens",
        "swa_full_tokens_ratio",
        "context_length",
        "swa_sizing",
        "chunked_prefill_size",
        "kv_layout",
        "compressed_kv_layout",
        "budget_bytes",
        "full_tokens",
    ):
        flag = "--budget" if field == "budget_bytes" else "--" + field.replace("_", "-")
        if message.startswith(f"{field}="):
            return f"{flag} {message[len(field) + 1 :]}"
    return message


def family_figures(bm: BufferMap) -> dict[str, dict[str, int]]:
    """Every figure per family, read from a ledger holding the buffer map (SGLang's own
    allocation: all runtime-owned, so physical and reserved bytes are the tensor bytes)."""
    ledger = Ledger()
    specs = bm.specs(pool="dsv4")
    for family in bm.families:
        fam_specs = [s for s in specs if s.family == family]
        if fam_specs:
            ledger.add_account(fam_specs, key=f"dsv4/{family}")
    rollup = ledger.snapshot(reconcile=False).rollup("family")
    zero = {f.name: 0 for f in FIGURES}
    return {family: dict(rollup.get((family,), zero)) for family in bm.families}


def document(bm: BufferMap) -> dict[str, Any]:
    d = bm.to_dict()
    figures = family_figures(bm)
    d["figures"] = [f.name for f in FIGURES]
    d["families"] = {family: {**figures[family], **d["families"][family]} for family in bm.families}
    d["totals"] = {
        **{
            f.name: sum(figures[fam][f.name] for fam in bm.families)
            for f in FIGURES
            if not f.per_account
        },
        **d["totals"],
    }
    return d


def table(bm: BufferMap) -> str:
    s = bm.sizes
    k = bm.knobs
    sh = bm.shape
    low = "".join(
        f", {len(sh.layers(r))} x C{r} ({len(sh.sources(r))} kv_source)"
        for r in (1, 2)
        if sh.layers(r)
    )
    layouts = ", ".join(
        f"{'swa' if r == 0 else f'c{r}'} {lay}"
        for r, lay in bm.pricing.kv_layouts.items()
        if r == 0 or sh.owner_layers(r)
    )
    lines = [
        f"DeepSeek-V4{'.1' if sh.has_low_ratios else ''} buffer map (SGLang 0.5.23 layout) "
        f"for {sh.source}",
        f"  layers {sh.num_hidden_layers}: {len(sh.layers(0))} x SWA only, "
        f"{len(sh.layers(4))} x C4, {len(sh.layers(128))} x C128"
        + low
        + _mtp_note(len(sh.mtp_ratios)),
        f"  KV layouts: {layouts}",
        f"  knobs: page {k.page_size}, state {k.state_dtype}, indexer {k.indexer_dtype}, "
        f"draft tokens {k.speculative_draft_tokens}, "
        + (
            f"swa ratio {k.swa_full_tokens_ratio}"
            if k.swa_sizing == "ratio"
            else f"swa cap {bm.pricing.swa_cap_tokens} tokens"
        ),
        f"  tokens: full {s.full_tokens}, swa {s.swa_tokens}, c4 {s.c4_tokens}, c128 {s.c128_tokens}; "
        f"state rows: c4 {s.c4_state_size}, c128 {s.c128_state_size}; "
        f"max running requests {s.max_running_requests}",
    ]
    if bm.budget_bytes is not None:
        lines.append(
            f"  budget {bm.budget_bytes} B ({format_size(bm.budget_bytes)}): "
            f"{bm.pricing.bytes_per_full_token:.2f} B per full token, "
            f"{bm.fixed_bytes} B fixed (c128 state for {bm.planning_max_running_requests} requests"
            + (", ratio-2 pair state" if bm.families.get("c2_state") else "")
            + (", SWA cap" if bm.pricing.swa_cap_tokens is not None else "")
            + ")"
            + (
                f", {bm.draft_reserve_bytes} B left for the draft worker"
                if bm.draft_reserve_bytes
                else ""
            )
        )
    header = ("family", "buffers", "shape", "dtype", "planned bytes", "allocated bytes", "overhead")
    rows = [header]
    for family, fp in bm.families.items():
        pct = "-" if fp.overhead_pct is None else f"{fp.overhead_pct:+.3f}%"
        shape = "x".join(map(str, fp.shape)) if fp.shape else "-"
        rows.append(
            (
                family,
                str(len(fp.layers)),
                shape,
                fp.dtype or "-",
                f"{fp.planned_bytes:,}",
                f"{fp.allocated_bytes:,}",
                pct,
            )
        )
    planned, allocated = bm.total_planned_bytes, bm.total_allocated_bytes
    total_pct = f"{100.0 * (allocated - planned) / planned:+.3f}%" if planned else "-"
    rows.append(
        ("total", str(len(bm.buffers)), "", "", f"{planned:,}", f"{allocated:,}", total_pct)
    )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    right = {1, 4, 5, 6}
    lines.append("")
    for n, r in enumerate(rows):
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if n == 0 or n == len(rows) - 2:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(f"allocated {format_size(allocated)} for {format_size(planned)} planned")
    return "\n".join(lines) + "\n"


def _mtp_note(n: int) -> str:
    if n == 0:
        return ""
    return f" (+{n} MTP {'entry' if n == 1 else 'entries'} in compress_ratios, not in this pool)"
