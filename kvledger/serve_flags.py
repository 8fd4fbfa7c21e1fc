"""`kvledger serve`'s flags: the server's, the snapshot directory's, the demo's and its
workload's, each with its bounds and default (`kvledger serve --help` prints them)."""

from __future__ import annotations

import argparse

from accounting.units import format_size
from exporter.server import malloc_exec
from exporter.server.token import ENV
from kvledger.argtypes import number, one_line_errors, size


def _range(text: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` tokens."""
    lo, sep, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a token count N or a range MIN:MAX"
        ) from None
    if not 1 <= a <= b <= MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 1 <= MIN <= MAX <= {MAX_TOKENS}")
    return a, b


MAX_TOKENS = 1 << 24
DAY = 86400.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    from accounting.snapfile.directory import TEMP_GRACE_S, default_snapshot_dir
    from accounting.snapfile.format import MAX_INTERVAL_S, MIN_INTERVAL_S
    from exporter.server import connections as conn
    from kvledger.demo import source as demo

    one_line_errors(p)
    net = p.add_argument_group("server")
    net.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind; one other than loopback needs a token or --insecure-no-token "
        "(default: %(default)s)",
    )
    net.add_argument(
        "--port",
        type=number(int, 0, 65535),
        default=8000,
        help="port, 0 for any free one (default: %(default)s)",
    )
    net.add_argument(
        "--token-file",
        metavar="FILE",
        default=None,
        help="file holding the bearer token /debug/* requires (yours, mode 0600 or 0640); "
        f"default: ${ENV} if set, else no token",
    )
    net.add_argument("--token", default=None, help=argparse.SUPPRESS)  # refused: see run()
    net.add_argument(
        "--web.config.file",
        dest="web_config_file",
        metavar="FILE",
        default=None,
        help="TLS and basic auth, in the web configuration format of Prometheus exporters "
        "(exporter-toolkit: tls_server_config cert_file/key_file, basic_auth_users with bcrypt "
        "hashes); basic auth then guards every path, /debug/* included, instead of a token "
        "(docs/security.md)",
    )
    net.add_argument(
        "--insecure-no-token",
        action="store_true",
        help="allow a non-loopback --host without a token (/debug/* open to the network)",
    )
    lim = p.add_argument_group("client limits (what one local client may hold; docs/security.md)")
    lim.add_argument(
        "--max-connections",
        type=number(int, 1, 1 << 20),
        default=None,
        help="client connections held at most; past it the one waiting longest for its "
        "request is closed, or the new one refused with 503 when all are being answered "
        f"(default: what the file-descriptor limit allows, at most {conn.DEFAULT_MAX_CONNECTIONS}; "
        "the soft limit is raised to the hard one at start)",
    )
    lim.add_argument(
        "--request-timeout",
        type=number(float, 0, 3600, lo_open=True),
        default=conn.DEFAULT_REQUEST_TIMEOUT_S,
        help="seconds a connection has to send a complete request line and headers, from "
        "its start or its previous response; then it is closed (default: %(default)g)",
    )
    lim.add_argument(
        "--max-header-bytes",
        type=size(1024, 1 << 24),
        default=conn.DEFAULT_HEADER_BYTES,
        help="bytes of request line and headers accepted; a larger head is answered 400 and "
        f"closed (default: {format_size(conn.DEFAULT_HEADER_BYTES)})",
    )
    lim.add_argument(
        "--max-headers",
        type=number(int, 1, 10_000),
        default=conn.DEFAULT_MAX_HEADERS,
        help="header fields accepted; more are answered 431 and closed (default: %(default)s)",
    )
    lim.add_argument(
        "--keep-alive",
        type=number(int, 1, 3600),
        default=conn.DEFAULT_KEEP_ALIVE_S,
        help="seconds an idle kept-alive connection stays open (default: %(default)s)",
    )
    net.add_argument(
        "--snapshot-dir",
        default=None,
        help="directory engines publish snapshots into; created 0700, refused when another "
        f"user owns it or others can write it (default: {default_snapshot_dir()})",
    )
    net.add_argument(
        "--snapshot-dir-group-writable",
        action="store_true",
        help="accept a group-writable snapshot directory and its group's files (engines of "
        "several users in one group); never one writable by others or owned by another user",
    )
    net.add_argument(
        "--stale-after",
        type=number(float, 0, DAY, lo_open=True),
        default=None,
        help="seconds before a silent source is stale (default: 3 publish intervals + 1 s)",
    )
    net.add_argument(
        "--forget-after",
        type=number(float, 0, 30 * DAY, lo_open=True),
        default=3600.0,
        help="seconds after which a stale source nothing replaced is no longer listed "
        "(default: %(default)g)",
    )
    net.add_argument(
        "--temp-grace",
        type=number(float, 0, DAY, lo_open=True),
        default=TEMP_GRACE_S,
        help="seconds after which a publisher's temporary file (.NAME.json.HEX.tmp, a "
        "regular file of this user) is taken as left by a writer killed mid-write and "
        "removed (default: %(default)g)",
    )
    net.add_argument(
        "--scan-interval",
        type=number(float, 0, 60),
        default=0.25,
        help="seconds between reads of the snapshot directory in the background, so a scrape "
        "finds new files parsed already; 0: only when a request comes (default: %(default)g)",
    )
    net.add_argument(
        "--malloc",
        choices=malloc_exec.CHOICES,
        default="python",
        help="the server's memory allocator: python (its own), or jemalloc, preloaded from "
        "the system's library by starting the command again (gives memory back after many "
        "sources come and go; exporter/server/malloc_exec.py) (default: %(default)s)",
    )
    net.add_argument(
        "--scrape-max-age",
        type=number(float, 0, 60),
        default=0.0,
        help="seconds a scrape may serve a changed file's version that the background scan "
        "parsed, instead of parsing it itself: bounds a scrape's cost when many ranks publish "
        "fast (0.5 with the default scan: every figure at most that old); 0: every scrape "
        "serves the files as they are (default: %(default)g)",
    )
    net.add_argument(
        "--log-interval",
        type=number(float, 0.1, DAY),
        default=10.0,
        help="seconds between status log lines (default: %(default)g)",
    )
    src = p.add_argument_group("embedded demo source")
    src.add_argument(
        "--no-demo", action="store_true", help="serve the snapshot directory only, no demo source"
    )
    src.add_argument(
        "--backend",
        choices=("host", "cuda"),
        default="host",
        help="VMM backend of the demo's SWA pool (default: %(default)s)",
    )
    src.add_argument(
        "--device",
        type=number(int, 0, 1023),
        default=0,
        help="CUDA device with --backend cuda (default: %(default)s)",
    )
    src.add_argument(
        "--config",
        default=None,
        help="HF config.json of a DeepSeek-V4 model (default: the DeepSeek-V4-Flash shape "
        "shipped with kvledger)",
    )
    src.add_argument(
        "--budget",
        type=size(1, 1 << 50),
        default=demo.DEFAULT_BUDGET,
        help=f"KV-cache byte budget to size the pool (default: {format_size(demo.DEFAULT_BUDGET)})",
    )
    src.add_argument(
        "--model-name", default="deepseek-v4-flash", help="model_name label (default: %(default)s)"
    )
    src.add_argument(
        "--tp-rank",
        type=number(int, 0, 1 << 16),
        default=0,
        help="tp_rank label of the demo source (default: %(default)s)",
    )
    src.add_argument(
        "--max-running-requests",
        type=number(int, 1, 1 << 20),
        default=demo.DEFAULT_MAX_RUNNING,
        help="request slots the pool is sized for (default: %(default)s)",
    )
    src.add_argument(
        "--context-length",
        type=number(int, 1, MAX_TOKENS),
        default=demo.DEFAULT_CONTEXT_LENGTH,
        help="tokens per request the pool is sized for (default: %(default)s)",
    )
    src.add_argument(
        "--host-page-size",
        type=size(4096, 1 << 30),
        default=demo.DEFAULT_HOST_GRANULARITY,
        help=f"host backend page (granularity) (default: "
        f"{format_size(demo.DEFAULT_HOST_GRANULARITY)})",
    )
    src.add_argument(
        "--interval",
        type=number(float, MIN_INTERVAL_S, MAX_INTERVAL_S),
        default=1.0,
        help="seconds between the demo's snapshots; the exporter believes at most 60 s of a "
        "source's interval, so a longer one needs --stale-after (default: %(default)g)",
    )
    wl = p.add_argument_group("built-in workload")
    wl.add_argument(
        "--rate",
        type=number(float, 0, 1e6, lo_open=True),
        default=1.0,
        help="requests per second (default: %(default)g)",
    )
    wl.add_argument(
        "--prompt-tokens",
        type=_range,
        default=(256, 2048),
        help="prompt tokens per request, N or MIN:MAX (default: 256:2048)",
    )
    wl.add_argument(
        "--output-tokens",
        type=_range,
        default=(64, 512),
        help="output tokens per request, N or MIN:MAX (default: 64:512)",
    )
    wl.add_argument(
        "--step-ms",
        type=number(float, 0, 60_000, lo_open=True),
        default=20.0,
        help="milliseconds per decode step (default: %(default)g)",
    )
    wl.add_argument(
        "--seed",
        type=number(int, 0, 2**63 - 1),
        default=None,
        help="random seed of the workload (default: a fresh one each run)",
    )
