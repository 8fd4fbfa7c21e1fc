"""`kvledger dashboards`: write the Grafana dashboard and Prometheus files to a folder.

Writes, from the installed package: the KV-cache Grafana dashboard and its
provisioning (grafana/), Prometheus scrape configs, recording rules, alerts and
the alerts' promtool unit tests (prometheus/), and a README.md saying how to
mount them. The dashboard and rules are generated from the exporter's metric
table, so they match the installed kvledger. With --check DIR, writes nothing
and exits 1 naming each file under DIR that differs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvledger.dashboards import files


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "example: kvledger dashboards --out ./kvledger-dashboards, then "
        "prometheus --config.file=./kvledger-dashboards/prometheus/prometheus.yml "
        "(README.md in the folder has the Grafana steps)"
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        help="folder to write the files into (created if missing; files there are replaced)",
    )
    where.add_argument(
        "--check",
        metavar="DIR",
        type=Path,
        help="compare DIR with what --out would write; exit 1 naming each differing file",
    )


def run(args: argparse.Namespace) -> int:
    if args.check is not None:
        stale = files.stale(args.check)
        for rel in stale:
            print(
                f"{args.check / rel} differs from the generator: run kvledger dashboards "
                f"--out {args.check}"
            )
        return 1 if stale else 0
    for path in files.write(args.out):
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvledger.dashboards",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
