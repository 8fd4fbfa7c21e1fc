"""`python -m kvledger.dashboards [--check]`: write the generated files under dashboards/,
or (with --check) exit 1 naming those that differ from the generator's output."""

from __future__ import annotations

import argparse
import sys

from kvledger.dashboards import files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvledger.dashboards", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    if args.check:
        stale = files.stale()
        for rel in stale:
            print(f"dashboards/{rel} differs from the generator: run python -m kvledger.dashboards")
        return 1 if stale else 0
    for path in files.write():
        print(f"wrote {path.relative_to(files.ROOT.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
