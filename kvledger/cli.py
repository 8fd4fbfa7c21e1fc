"""`kvledger` command line. Each subcommand lives in its own module, imported when used.

A subcommand module defines `add_arguments(parser)` and `run(args) -> int`.
Bad input ends with one line on stderr naming the value and what was expected,
and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": (
        "kvledger.serve",
        "run the exporter (by default on an embedded DeepSeek-V4-shaped demo)",
    ),
    "inspect": ("kvledger.inspect", "print the DeepSeek-V4 buffer map for a config and a size"),
    "bench": ("kvledger.bench", "benchmarks: alloc, scrape, tp"),
}


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvledger", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            p.set_defaults(_module=None, _missing=module)
            continue
        mod.add_arguments(p)
        p.set_defaults(_module=mod)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args._module is None:
        print(
            f"kvledger: command {args.command!r} is not available in this build ({args._missing})",
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
