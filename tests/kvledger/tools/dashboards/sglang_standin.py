"""A stand-in for SGLang 0.5.23's `/metrics`, served the way SGLang serves it, with prometheus-client
alone (SGLang is not imported).

What it reproduces, from SGLang 0.5.23's source:
- `sglang/srt/utils/common.py`, `add_prometheus_middleware(app)`: a `CollectorRegistry` with
  a `multiprocess.MultiProcessCollector`, `make_asgi_app(registry=registry)` mounted at
  `/metrics` on the server's app (a Starlette `Mount`, its `path_regex` widened to
  `^/metrics(?P<path>.*)$` against the 307 redirect), with `PROMETHEUS_MULTIPROC_DIR` set
  before prometheus-client is imported;
- `sglang/srt/observability/metrics_collector.py`: the gauge `sglang:kv_cache_memory_usage_gb`,
  `multiprocess_mode="mostrecent"`, labelled with the scheduler's labels and set through
  `gauge.labels(**labels).set(value)`.

Run as `python -m tests.kvledger.tools.dashboards.sglang_standin MULTIPROC_DIR VALUE`: it prints its base URL
on one line, then serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import os
import re
import socket
import sys

LABELS = {
    "model_name": "deepseek-v4-flash",
    "engine_type": "unified",
    "tp_rank": "0",
    "pp_rank": "0",
    "moe_ep_rank": "0",
}


def main(multiproc_dir: str, value: float) -> None:
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = multiproc_dir  # before prometheus_client
    import uvicorn
    from fastapi import FastAPI
    from prometheus_client import CollectorRegistry, Gauge, make_asgi_app, multiprocess
    from starlette.routing import Mount

    gauge = Gauge(
        name="sglang:kv_cache_memory_usage_gb",
        documentation="Memory used by the KV cache pools in GB.",
        labelnames=LABELS.keys(),
        multiprocess_mode="mostrecent",
    )
    gauge.labels(**LABELS).set(value)

    app = FastAPI()
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    metrics_route = Mount("/metrics", make_asgi_app(registry=registry))
    metrics_route.path_regex = re.compile("^/metrics(?P<path>.*)$")
    app.routes.append(metrics_route)

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    print(f"http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off")).run(sockets=[sock])


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
