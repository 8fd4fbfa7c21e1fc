"""`kvledger` command line: one module per subcommand, imported only when that subcommand runs.

A subcommand module defines `add_arguments(parser)` and `run(args) -> int`; its
docstring is its `--help` description, so it is written for users. Bad input ends with one
line on stderr naming the value and what was expected, and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

from exporter.server.errors import UsageError
from kvledger import __version__

DESCRIPTION = """\
kvledger accounts for an LLM server's KV-cache memory: tensor bytes, reserved
address space, physical memory and occupied slots, per buffer family, per pool
and per rank. It exports them to Prometheus as sglang:kv_cache_memory_usage_gb
and per-family gauges, serves the buffer map at /debug/kv, and models the
DeepSeek-V4 KV cache that SGLang 0.5.23 allocates."""

EPILOG = """\
Run `kvledger COMMAND --help` for a command's options. Documentation:
README.md and docs/ in the source distribution."""

# name -> (module, one-line help). A module is imported only when its command is used.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": (
        "kvledger.serve",
        "run the exporter (/metrics, /debug/kv), by default on an embedded DeepSeek-V4-shaped demo",
    ),
    "inspect": (
        "kvledger.tools.inspect",
        "print the DeepSeek-V4 buffer map SGLang 0.5.23 allocates for a config and a size",
    ),
    "inspect-vllm": (
        "kvledger.tools.inspect_vllm",
        "print the KV cache vLLM 0.33 would allocate per KV-cache group for a config and a memory size",
    ),
    "dashboards": (
        "kvledger.tools.dashboards.command",
        "write the Grafana dashboard, provisioning, Prometheus scrape configs and rules, "
        "and Kubernetes manifests",
    ),
    "bench": ("kvledger.tools.bench", "benchmarks of the allocation path, the scrape path and TP"),
}


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (`kvledger inspect: argument ...`)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def _description(module: object, fallback: str) -> str:
    """A subcommand module's docstring as its --help text, less the "`kvledger NAME`: " tag."""
    doc = inspect.cleandoc(getattr(module, "__doc__", None) or "")
    doc = re.sub(r"^`kvledger [\w ]+`: ", "", doc)
    return doc[:1].upper() + doc[1:] if doc else fallback


def build_parser(command: str | None = None) -> Parser:
    """The parser; only `command`'s module (if any) is imported to add its options."""
    parser = Parser(
        prog="kvledger",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvledger {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        if name != command:
            sub.add_parser(name, help=help_text, description=help_text)
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            p = sub.add_parser(name, help=help_text, description=help_text)
            p.set_defaults(_module=None, _missing=module)
            continue
        p = sub.add_parser(
            name,
            help=help_text,
            description=_description(mod, help_text),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.add_arguments(p)
        p.set_defaults(_module=mod)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand named in `argv`: the first argument that is not an option (the
    top-level options take no value)."""
    for arg in argv:
        if arg == "--":
            return None
        if not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from exporter.server import early_signals

        early_signals.install()  # the `kvledger` script's first step (exporter.server.early_signals)
        from kvledger.argtypes import join_negative_values

        argv = join_negative_values(sys.argv[1:] if argv is None else argv)
        parser = build_parser(_command(argv))
        args = parser.parse_args(argv)
        if args._module is None:
            print(
                f"kvledger: command {args.command!r} is not available in this build "
                f"({args._missing})",
                file=sys.stderr,
            )
            return 2
        try:
            return int(args._module.run(args) or 0)
        except UsageError as e:
            print(f"kvledger {args.command}: {e}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # Run as `python -m kvledger.cli`: hand over to the imported module, so subcommands'
    # `kvledger.cli.UsageError` is the class caught here (not a `__main__` copy).
    from kvledger.cli import main as _main

    sys.exit(_main())
