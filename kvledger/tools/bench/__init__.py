"""`kvledger bench NAME`: run one of kvledger's benchmarks and print what it measured.

docs/benchmarks.md has each benchmark's command, what it measures, its current
figures per machine and its targets; docs/benchmarks-history.md the chronological
record of every run. Run `kvledger bench NAME --help` for a benchmark's
options. (For developers: each benchmark is a module `kvledger.tools.bench.NAME` with
`add_arguments(parser)` and `run(args) -> int`; one missing from the build is
listed as "not available".)
"""

from __future__ import annotations

import argparse
import importlib
import sys

BENCHMARKS: dict[str, str] = {
    "alloc": "the SWA pool's allocation path and page maps, side by side with the driver floor",
    "scrape": "scrape latency over many ranks, and the allocation-path cost of accounting",
    "tp": "tensor-parallel page operations across ranks",
    "sglang": "SGLang's own DeepSeek-V4 allocator, native and bridged onto kvledger's VMM pool",
    "vllm-cost": "kvledger's vLLM plugin in a live vLLM server: step-path time, tokens/s off/on",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, help_text in BENCHMARKS.items():
        module = f"{__name__}.{name.replace('-', '_')}"
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            b = sub.add_parser(name, help=f"{help_text} (not available)", description=help_text)
            b.set_defaults(_bench=None, _bench_missing=module)
            continue
        b = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(b)
        b.set_defaults(_bench=mod)


def run(args: argparse.Namespace) -> int:
    if args._bench is None:
        print(
            f"kvledger bench: {args.benchmark!r} is not available in this build "
            f"({args._bench_missing})",
            file=sys.stderr,
        )
        return 2
    return int(args._bench.run(args) or 0)
