"""`kvledger dashboards`: write the Grafana dashboard and Prometheus files to a folder.

Writes, from the installed package: the KV-cache Grafana dashboard and its
provisioning (grafana/), Prometheus scrape configs, recording rules, alerts and
the alerts' promtool unit tests (prometheus/), Kubernetes manifests for a cluster
(kubernetes/: a DaemonSet of exporters on the GPU nodes, a Service, a Prometheus
Operator ServiceMonitor), and a README.md saying how to mount and deploy them. The dashboard and rules are generated from the exporter's metric
table, so they match the installed kvledger. With --check DIR, writes nothing
and exits 1 naming each file under DIR that differs. A folder that cannot be
created or written is refused in one line (exit 2).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvledger.tools.dashboards import files


def _folder(text: str) -> Path:
    """A folder name; '' is refused (Path('') is the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a folder name (an empty one would mean the current directory; "
            "write . for that)"
        )
    return Path(text)


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
        type=_folder,
        help="folder to write the files into (created if missing; files there are replaced)",
    )
    where.add_argument(
        "--check",
        metavar="DIR",
        type=_folder,
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
    from kvledger.cli import UsageError

    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out}: not a folder, expected a folder to write into")
    try:
        written = files.write(args.out)
    except OSError as e:
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(args.out) else ""
        raise UsageError(
            f"--out {args.out}: cannot write there{where}: {e.strerror or e}; expected a "
            "folder that exists or can be created"
        ) from None
    for path in written:
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m kvledger.tools.dashboards`: the same command through `kvledger.cli`."""
    import sys

    from kvledger.cli import main as cli_main

    return cli_main(["dashboards", *(sys.argv[1:] if argv is None else argv)])
