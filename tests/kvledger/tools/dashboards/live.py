"""`kvledger serve` (the embedded demo and its workload) and a real Prometheus loading the
recording rules and alerts, both on loopback; closed by `close()` / the context manager."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

import httpx

from tests.kvledger.tools.dashboards import names
from tests.servers import Prometheus, ServeProcess, wait_until

SERVE_ARGS = ("--interval", "0.2", "--rate", "40", "--step-ms", "5", "--seed", "7")


class KvledgerServe:
    """`python -m kvledger serve --port 0` in a subprocess; `.base` is its URL."""

    def __init__(self, snapshot_dir: Path, *args: str) -> None:
        self.log_path = snapshot_dir.parent / f"{snapshot_dir.name}-serve.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        try:
            self.server = ServeProcess(
                [
                    "--port",
                    "0",
                    "--snapshot-dir",
                    str(snapshot_dir),
                    "--log-interval",
                    "30",
                    *(args or SERVE_ARGS),
                ],
                stderr=self._log,
            )
        except RuntimeError as e:
            self._log.close()
            raise RuntimeError(
                f"{e}; log: {self.log_path.read_text(errors='replace')[-3000:]}"
            ) from None
        self.proc = self.server.proc
        try:
            self.base = self.server.url
            self.target = self.base.removeprefix("http://")
            wait_until(
                lambda: httpx.get(f"{self.base}/readyz", timeout=2).status_code == 200,
                20,
                "kvledger serve ready",
            )
        except BaseException:
            self.close()
            raise

    def debug(self) -> dict[str, Any]:
        r = httpx.get(f"{self.base}/debug/kv", headers={"Accept": "application/json"}, timeout=5)
        r.raise_for_status()
        return dict(r.json())

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-3000:]

    def close(self) -> None:
        self.server.close()
        self._log.close()

    def __enter__(self) -> KvledgerServe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RulesPrometheus(Prometheus):
    """tests.servers.Prometheus with dashboards/prometheus's rule files loaded (evaluated every
    `interval`), scraping `targets` as job "kvledger"."""

    def __init__(self, targets: list[str], *, interval: str = "1s") -> None:
        super().__init__(targets, interval=interval, job="kvledger")
        for rule_file in ("recording_rules.yml", "alerts.yml"):
            shutil.copy(names.PROM / rule_file, self.dir / rule_file)
        config = self.dir / "prometheus.yml"
        text = config.read_text()
        head, sep, rest = text.partition("scrape_configs:\n")
        if not sep:
            raise RuntimeError(f"unexpected test Prometheus config:\n{text}")
        config.write_text(
            head
            + f"  evaluation_interval: {interval}\n"
            + "rule_files:\n  - recording_rules.yml\n  - alerts.yml\n"
            + sep
            + rest
        )

    def query_at(self, expr: str) -> list[dict[str, Any]]:
        with contextlib.suppress(httpx.HTTPStatusError):
            return self.query(expr)
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=5)
        raise RuntimeError(f"prometheus rejected {expr!r}: {r.text}")

    def rules(self) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.url}/api/v1/rules", timeout=5)
        r.raise_for_status()
        return [rule for g in r.json()["data"]["groups"] for rule in g["rules"]]
