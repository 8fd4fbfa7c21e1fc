"""vLLM through the exporter, proven through a real Prometheus.

A worker process allocates vLLM's real KVCacheConfig through kvledger's patched
`initialize_kv_cache_tensors` (CPU tensors, as vLLM builds them); this process runs the
engine core's side on vLLM's real KVCacheManager / BlockPool, driven through allocate,
prefix hit, free and eviction, publishing through the patched `schedule`. A real
`kvledger serve` reads the snapshot directory and Debian's Prometheus scrapes it: at
every step the stored `kvledger_vllm_*` figures equal the tensors' and the pool's own
counts, the dashboard's vLLM row returns them, and no `sglang:` series is made of a vLLM
source. Then the worker is killed (its bytes go, `kvledger_up` 0, the occupancy stays)
and restarted (the dead one's file removed, the new one served).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.servers import PROMETHEUS, Prometheus, ServeProcess, repo_env, wait_until

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(PROMETHEUS), reason="needs Debian's prometheus"),
]
ROOT = Path(__file__).resolve().parents[4]
INTERVAL = 0.1
W = '{model_name="tiny", engine="0", tp_rank="0", pp_rank="0"}'
E = '{model_name="tiny", engine="0"}'


class Worker:
    """tests.kvledger.engines.vllm.worker_proc in a child process; `.truth` what it printed."""

    def __init__(self, snapdir: Path, *, wait: bool = False) -> None:
        env = {
            **repo_env(),
            "KVLEDGER_VLLM": "1",
            "KVLEDGER_SNAPSHOT_DIR": str(snapdir),
            "KVLEDGER_PUBLISH_INTERVAL": str(INTERVAL),
            "VLLM_TARGET_DEVICE": "cpu",
        }
        env.pop("KVLEDGER_VLLM_REQUIRE", None)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.kvledger.engines.vllm.worker_proc",
                *(["--wait"] if wait else []),
            ],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.truth: dict = {}
        self.wait = wait
        if not wait:
            self.start()

    def start(self) -> None:
        """Allocate (a --wait worker), and read what the tensors say."""
        assert self.proc.stdout is not None and self.proc.stdin is not None
        from tests.kvledger.engines.vllm.worker_proc import MARK

        if self.wait:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.truth = json.loads(line.removeprefix(MARK))
                return
        self.close()
        raise RuntimeError(f"worker_proc printed no figures: {self.stderr[-3000:]}")

    stderr = ""
    closed = False

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.proc.poll() is None:
            self.proc.kill()
        _, err = self.proc.communicate(timeout=10)
        self.stderr = err or ""


def _value(prom: Prometheus, q: str) -> float | None:
    got = prom.query(q)
    if len(got) != 1:
        return None
    return float(got[0]["value"][1])


def _wait_equal(prom: Prometheus, expected: dict[str, float], what: str) -> None:
    def ok() -> bool:
        return all(_value(prom, q) == v for q, v in expected.items())

    try:
        wait_until(ok, 20, what, interval=0.2)
    except TimeoutError:
        got = {q: _value(prom, q) for q in expected}
        wrong = {q: (got[q], v) for q, v in expected.items() if got[q] != v}
        raise AssertionError(f"{what}: (stored, expected) {wrong}") from None


def _worker_expected(truth: dict) -> dict[str, float]:
    out = {
        f"kvledger_vllm_kv_cache_physical_bytes{W}": truth["storage"],
        f"kvledger_vllm_kv_cache_blocks{W}": truth["blocks"],
        f"kvledger_vllm_kv_block_bytes{W}": truth["block_bytes"],
    }
    for g in truth["groups"]:
        sel = W[:-1] + f', group="{g["group"]}", kind="{g["kind"]}"}}'
        out[f"kvledger_vllm_group_tensor_bytes{sel}"] = g["tensor_bytes"]
        out[f"kvledger_vllm_group_physical_bytes{sel}"] = truth["storage"]
        out[f"kvledger_vllm_group_reserved_bytes{sel}"] = truth["storage"]
        out[f"kvledger_vllm_group_slot_bytes{sel}"] = g["slot_bytes"]
        out[f"kvledger_vllm_group_block_size{sel}"] = g["block_size"]
        out[f"kvledger_vllm_group_layers{sel}"] = g["layers"]
    return out


def _engine_expected(manager, truth: dict) -> dict[str, float]:
    """What the pool itself says, walked block by block (kvledger keeps counters instead)."""
    from tests.kvledger.engines.vllm.test_occupancy import _truth

    pool = manager.block_pool
    t = _truth(manager)
    free = pool.get_num_free_blocks()
    out = {
        f"kvledger_vllm_blocks{E}": pool.num_gpu_blocks,
        f"kvledger_vllm_occupied_blocks{E}": pool.num_gpu_blocks - free,
        f"kvledger_vllm_free_blocks{E}": free,
        f"kvledger_vllm_evictable_blocks{E}": t["evictable"],
    }
    for g in truth["groups"]:
        i, bs = g["group"], g["block_size"]
        sel = E[:-1] + f', group="{i}", kind="{g["kind"]}"}}'
        out[f"kvledger_vllm_group_capacity_slots{sel}"] = pool.num_gpu_blocks * bs
        out[f"kvledger_vllm_group_occupied_slots{sel}"] = t[i]
        out[f"kvledger_vllm_group_free_slots{sel}"] = free * bs
        out[f"kvledger_vllm_group_evictable_slots{sel}"] = t["evictable"] * bs
    return out


def _publish(sched) -> None:
    """One engine step's publish, through kvledger's wrapper of Scheduler.schedule."""
    from kvledger.engines.vllm import hooks

    time.sleep(INTERVAL * 1.2)  # a publish is due
    hooks._wrap_schedule(lambda self: None)(sched)


def test_vllm_figures_through_kvledger_serve_and_prometheus(tmp_path, monkeypatch) -> None:
    from kvledger.engines.vllm import hooks
    from tests.kvledger.engines.vllm import worker_proc
    from tests.kvledger.engines.vllm.test_occupancy import _manager, _request, _run

    snapdir = tmp_path / "snap"
    snapdir.mkdir(mode=0o700)
    monkeypatch.setenv("KVLEDGER_SNAPSHOT_DIR", str(snapdir))
    monkeypatch.setenv("KVLEDGER_PUBLISH_INTERVAL", str(INTERVAL))
    monkeypatch.delenv("KVLEDGER_VLLM_REQUIRE", raising=False)
    cfg, config = worker_proc.build()
    assert len(config.kv_cache_groups) == 2  # full attention and sliding window
    worker = Worker(snapdir)
    successor = Worker(snapdir, wait=True)  # vLLM imported while the first one runs
    try:
        with (
            ServeProcess(["--port", "0", "--no-demo", "--snapshot-dir", str(snapdir)]) as serve,
            Prometheus([serve.url.removeprefix("http://")], interval="250ms") as prom,
        ):
            assert hooks.install()
            manager = _manager(config)
            sched = SimpleNamespace(vllm_config=cfg, kv_cache_manager=manager, running=[])
            hooks._add_scheduler(sched)  # what the patched Scheduler.__init__ does
            truth = worker.truth
            assert truth["blocks"] == manager.block_pool.num_gpu_blocks
            _publish(sched)
            _wait_equal(
                prom, {**_worker_expected(truth), **_engine_expected(manager, truth)}, "at start"
            )

            # Allocate, free (cached blocks become evictable), prefix hit, fill (eviction on
            # reuse), evict_blocks, free all, reset_prefix_cache: equal at every step.
            a = _request("a", list(range(100)))
            steps: list[Callable[[], Any]] = [lambda: _run(a, manager), lambda: manager.free(a)]
            b = _request("b", list(range(100)) + [7] * 20)
            steps += [lambda: _run(b, manager), lambda: manager.free(b)]
            fill = [_request(f"f{i}", [1000 + i] * 64) for i in range(6)]
            steps += [functools.partial(_run, r, manager) for r in fill]
            steps.append(
                lambda: manager.evict_blocks({blk.block_id for blk in manager.block_pool.blocks})
            )
            steps += [lambda: [manager.free(r) for r in fill], manager.reset_prefix_cache]
            evictable, results = [], []
            for n, step in enumerate(steps):
                results.append(step())
                _publish(sched)
                expected = _engine_expected(manager, truth)
                evictable.append(expected[f"kvledger_vllm_evictable_blocks{E}"])
                _wait_equal(prom, expected, f"step {n}")
            assert results[2] > 0  # b's prompt hit a's cached blocks
            assert evictable[1] > 0 and evictable[-1] == 0  # cached after a free; reset: none

            # A request running: the joins of the engine core's slots with the worker's bytes
            # (the dashboard's PromQL) give its bytes per group and the memory left.
            c = _request("c", list(range(500, 700)))
            _run(c, manager)
            sched.running.append(c)  # its footprint: the histogram's one request
            _publish(sched)
            expected = _engine_expected(manager, truth)
            _wait_equal(prom, expected, "a request running")
            free = manager.block_pool.get_num_free_blocks()
            joins = {
                f"kvledger_vllm_free_blocks{E} * on(model_name, engine) group_right "
                f"kvledger_vllm_kv_block_bytes{W}": free * truth["block_bytes"]
            }
            from tests.kvledger.engines.vllm.test_occupancy import _truth

            held = _truth(manager)
            for g in truth["groups"]:
                sel = f'{{group="{g["group"]}"}}'
                q = (
                    f"kvledger_vllm_group_occupied_slots{sel} * on(model_name, engine, group) "
                    f"group_right kvledger_vllm_group_slot_bytes{sel}"
                )
                joins[q] = held[g["group"]] * g["slot_bytes"]
                assert joins[q] > 0
                # c alone runs: its footprint is the group's slots in use, counted once.
                joins[f"kvledger_vllm_request_slots_sum{sel}"] = held[g["group"]]
                joins[f"kvledger_vllm_request_slots_count{sel}"] = 1
                in_use = f'{{group="{g["group"]}",holder!="tree_evictable"}}'
                joins[f"sum(kvledger_vllm_group_held_slots{in_use})"] = held[g["group"]]
            joins["kvledger_vllm_running_requests"] = 1
            _wait_equal(prom, joins, "the joins")

            # The dashboard's vLLM row reads what is stored.
            from kvledger.tools.dashboards.kv_dashboard import vllm_row

            for panel in vllm_row().panels:
                for target in panel.targets:
                    q = target.expr.replace("$instance", ".*").replace("$model_name", ".*")
                    assert prom.query(q), (panel.title, q)

            # Nothing SGLang-named is made of vLLM sources; every source is up.
            assert prom.query('{__name__=~"sglang:.*"}') == []
            ups = {
                r["metric"]["engine_type"]: r["value"][1]
                for r in prom.query('kvledger_up{job="kvledger"}')
            }
            assert ups == {"vllm_worker": "1", "vllm_scheduler": "1"}

            # The worker dies: its bytes go, it is down, the engine core's figures stay.
            old = Path(truth["path"])
            worker.kill()
            _wait_equal(prom, {'kvledger_up{engine_type="vllm_worker"}': 0}, "worker down")
            assert prom.query(f"kvledger_vllm_kv_cache_physical_bytes{W}") == []
            assert _value(prom, f"kvledger_vllm_blocks{E}") == manager.block_pool.num_gpu_blocks
            assert old.exists()  # no successor yet: listed down until --forget-after

            # It restarts under the same labels: the dead one's file goes, the new one serves.
            worker = successor
            worker.start()
            _wait_equal(
                prom,
                {'kvledger_up{engine_type="vllm_worker"}': 1, **_worker_expected(worker.truth)},
                "worker restarted",
            )
            wait_until(lambda: not old.exists(), 10, "the dead worker's file removed")
    finally:
        worker.close()
        successor.close()
        hooks.uninstall()
