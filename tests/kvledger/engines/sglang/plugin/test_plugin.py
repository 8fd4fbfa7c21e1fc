"""kvledger as an SGLang 0.5.23 general plugin, loaded by SGLang's own `load_plugins()` from
kvledger's installed entry point (run through scripts/test-sglang; marker `sglang`).

Each SGLang process is a child (`scheduler_proc`): the hooks patch SGLang's classes for the
whole process and `load_plugins()` runs once per process, as in a server. The exporter is
`kvledger serve --no-demo` in a child of its own."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from allocator.backend import DEFAULT_GRANULARITY
from kvledger.engines.sglang.bridge.bridge import DEFAULT_POOL_OPTIONS
from tests.imports import ENTRY_POINT_OFF
from tests.kvledger.engines.sglang import rig
from tests.kvledger.engines.sglang.plugin import dist
from tests.servers import ServeProcess

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).resolve().parents[5]
TARGETS = {
    "sglang.srt.model_executor.model_runner.ModelRunner._init_post_memory_pool_components",
    "sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs",
    "sglang.srt.model_executor.model_runner.ModelRunner.post_capture_resize_kv_pool",
    "sglang.srt.managers.scheduler.Scheduler.release_host_resources",
    "sglang.srt.managers.scheduler.Scheduler.process_batch_result",
    "sglang.srt.managers.scheduler.Scheduler.on_idle",
    "sglang.srt.managers.scheduler.Scheduler.__init__",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache._evict",
    "sglang.srt.mem_cache.common.free_swa_out_of_window_slots",
    "sglang.srt.mem_cache.unified_cache.components.swa.free_swa_out_of_window_slots",
    "sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode",
}
LABELS = {
    "model_name": "kvl-plugin-test",
    "engine_type": "unified",
    "tp_rank": "0",
    "pp_rank": "0",
    "moe_ep_rank": "0",
}
DSV4_FAMILIES = {
    "swa_kv",
    "c4_kv",
    "c128_kv",
    "c4_indexer",
    "c4_attn_state",
    "c4_indexer_state",
    "c128_state",
}
HEADLINE = "sglang:kv_cache_memory_usage_gb"


_DIST: list[str] = []  # where the stand-in dist-info was written, once per session


def _dist_path() -> str | None:
    """None where kvledger is installed (its entry point is visible); else a folder holding the
    dist-info an install would write (`dist`), so SGLang's `load_plugins()` finds kvledger in
    a copy of the source tree too (the device machine runs one)."""
    if dist.installed():
        return None
    if not _DIST:
        where = Path(tempfile.mkdtemp(prefix="kvledger-dist-"))
        atexit.register(shutil.rmtree, where, True)
        _DIST.append(str(dist.write_dist_info(where)))
    return _DIST[0]


def _env(**kw: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KVLEDGER_") and k not in ("SGLANG_PLUGINS", "SGLANG_PLATFORM")
    }
    paths = (str(ROOT), _dist_path(), os.environ.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.update(kw)
    return env


class Proc:
    """scheduler_proc in a child process: one JSON line per command."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-m", "tests.kvledger.engines.sglang.plugin.scheduler_proc", *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr = ""
        self.first = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            err = self.p.stderr.read() if self.p.stderr else ""
            raise AssertionError(f"scheduler_proc said nothing; stderr:\n{err[-4000:]}")
        return json.loads(line)

    def send(self, cmd: str, *, answer: bool = True) -> dict[str, Any]:
        assert self.p.stdin is not None
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self._read() if answer else {}

    def wait(self) -> int:
        rc = self.p.wait(60)
        if self.p.stderr is not None and not self.p.stderr.closed:
            self.stderr = self.p.stderr.read()
        for f in (self.p.stdin, self.p.stdout, self.p.stderr):
            if f is not None:
                f.close()
        return rc

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.wait()


@pytest.fixture
def snapdir(tmp_path: Path) -> Path:
    d = tmp_path / "snap"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def exporter(snapdir: Path) -> Iterator[ServeProcess]:
    with ServeProcess(["--no-demo", "--snapshot-dir", str(snapdir), "--port", "0"]) as s:
        yield s


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return [
        (s.name, dict(s.labels), s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    ]


def debug_kv(url: str) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(url + "/debug/kv", timeout=10) as r:
        return json.loads(r.read())


def family_figure(samples: list, figure: str) -> dict[tuple[str, str], float]:
    name = f"sglang:kv_cache_{figure}"
    return {(lb["family"], lb["owner"]): v for n, lb, v in samples if n == name}


# -- discovery and switches -------------------------------------------------------------------
def test_sglang_discovers_kvledger_and_off_registers_nothing() -> None:
    from importlib.metadata import entry_points

    want = "kvledger.engines.sglang.plugin:register"
    if dist.installed():
        eps = {ep.name: ep.value for ep in entry_points(group=dist.GROUP)}
        assert eps.get("kvledger") == want
    else:  # a plain copy of the tree: the child finds the dist-info an install would write
        info = Path(_dist_path() or "")
        (ep,) = info.glob("kvledger-*.dist-info/entry_points.txt")
        assert ep.read_text() == f"[{dist.GROUP}]\nkvledger = {want}\n"
    proc = Proc(_env())  # KVLEDGER_SGLANG unset
    assert proc.wait() == 0
    assert proc.first["hooks"] == [] and proc.first["patched"] == []
    # SGLang ran the entry point (kvledger.engines.sglang.plugin imported) and it read its switch
    # (kvledger.engines.sglang.switches, accounting.switches), and nothing more of kvledger.
    assert proc.first["modules"] == ENTRY_POINT_OFF


def test_on_applies_the_hooks_to_sglang_real_targets() -> None:
    proc = Proc(_env(KVLEDGER_SGLANG="1"))
    assert proc.wait() == 0
    assert set(proc.first["hooks"]) == TARGETS
    assert set(proc.first["patched"]) == TARGETS  # HookRegistry applied them
    assert set(proc.first["wrapped"]) == TARGETS  # and the attribute is SGLang's wrapper


def test_sglang_plugins_naming_another_plugin_leaves_kvledger_out() -> None:
    proc = Proc(_env(KVLEDGER_SGLANG="1", SGLANG_PLUGINS="someone_else"))
    assert proc.wait() == 0
    assert proc.first["hooks"] == [] and proc.first["modules"] == []


def test_a_malformed_switch_is_logged_by_sglang_and_changes_nothing() -> None:
    proc = Proc(_env(KVLEDGER_SGLANG="maybe"))
    assert proc.wait() == 0
    assert proc.first["hooks"] == []


# -- the plugin path ----------------------------------------------------------------------------
def test_native_pool_published_and_exported_with_sglang_labels(
    snapdir: Path, exporter: ServeProcess
) -> None:
    proc = Proc(_env(KVLEDGER_SGLANG="1", KVLEDGER_SNAPSHOT_DIR=str(snapdir)), "--build")
    try:
        start = proc.first
        assert start["labels"] == LABELS and start["bridged"] is False
        assert start["index_translator"] == "KVIndexTranslator"  # SGLang's wiring ran after us
        assert Path(start["file"]).parent == snapdir and Path(start["file"]).exists()
        samples = scrape(exporter.url)
        (headline,) = [(lb, v) for n, lb, v in samples if n == HEADLINE]
        assert headline[0] == LABELS  # exactly SGLang's labels
        tensor = family_figure(samples, "tensor_bytes")
        assert {f for f, _ in tensor} == DSV4_FAMILIES | {"other"}  # + the full->SWA mapping
        assert {o for _, o in tensor} == {"runtime"}
        # Native pool: the headline is its tensor bytes, every storage it holds.
        assert headline[1] * 2**30 == sum(tensor.values()) == start["storages"]
        # SGLang's own allocator hands out pages; a native pool's memory does not move.
        answer = proc.send("prefill 600")
        assert family_figure(scrape(exporter.url), "tensor_bytes") == tensor
        # SGLang's own KV figure (0 for DeepSeek-V4 in SGLang 0.5.23) is kvledger's now
        assert answer["mem_usage"] == headline[1] > 0
    finally:
        proc.close()


@pytest.mark.parametrize(("pool", "name"), [("mla", "kv"), ("mha", "mha")])
def test_mla_and_mha_pools_through_the_inventory(
    snapdir: Path, exporter: ServeProcess, pool: str, name: str
) -> None:
    env = _env(KVLEDGER_SGLANG="1", KVLEDGER_SNAPSHOT_DIR=str(snapdir))
    proc = Proc(env, "--build", "--pool", pool)
    try:
        assert proc.first["pool"] == name and proc.first["labels"] == LABELS
        samples = scrape(exporter.url)
        (headline,) = [v for n, _, v in samples if n == HEADLINE]
        tensor = family_figure(samples, "tensor_bytes")
        # MLA: one latent buffer per layer; MHA: K and V halves of one storage per layer;
        # `other`: tensors SGLang keeps on the pool beside them (counted, not classified).
        assert "kv" in {f for f, _ in tensor} <= {"kv", "other"}
        assert headline * 2**30 == sum(tensor.values()) == proc.first["storages"]
    finally:
        proc.close()


def test_bridge_on_swa_is_vmm_owned_and_moves_with_sglang_allocations(
    snapdir: Path, exporter: ServeProcess
) -> None:
    env = _env(
        KVLEDGER_SGLANG="1", KVLEDGER_SGLANG_DSV4_BRIDGE="1", KVLEDGER_SNAPSHOT_DIR=str(snapdir)
    )
    # 256 SGLang pages of 149,760 B per layer: 18 host pages of 2 MiB. The bridge keeps the
    # front of SGLang's free list mapped ahead (DEFAULT_POOL_OPTIONS["ahead_rows"] rows, about 5
    # host pages), so a request of 120 pages maps beyond it and its finish unmaps again.
    proc = Proc(env, "--build", "--swa-pages", "256", "--full-pages", "320")
    try:
        assert proc.first["bridged"] is True, proc.first["reason"]

        def swa() -> tuple[float, float, float, float]:
            samples = scrape(exporter.url)
            phys = family_figure(samples, "physical_bytes")
            mapped = family_figure(samples, "mapped_bytes")
            occ = family_figure(samples, "occupied_slots")
            (headline,) = [v for n, _, v in samples if n == HEADLINE]
            assert ("swa_kv", "runtime") not in phys
            return (
                phys[("swa_kv", "vmm")],
                mapped[("swa_kv", "vmm")],
                occ[("swa_kv", "vmm")],
                headline,
            )

        idle_phys, idle_mapped, idle_occ, idle_head = swa()
        assert idle_occ == 0
        step = proc.send(f"prefill {120 * 256}")  # 120 SGLang pages: rows 1..120
        assert step["swa_free_pages"] == step["swa_pages"] - 120
        phys, mapped, occ, head = swa()
        assert occ == 120 * 256 and mapped > idle_mapped and phys > idle_phys
        assert (head - idle_head) * 2**30 == phys - idle_phys  # the headline moved by swa_kv
        # /debug/kv says which truth it was held against: the host memfd's allocated blocks.
        (src,) = debug_kv(exporter.url)["sources"]
        (rec,) = src["reconciliation"]
        assert (rec["source"], rec["basis"], rec["unattributed_bytes"]) == (
            "host_memfd",
            "memfd",
            0,
        )
        assert rec["device_bytes"] == phys
        peak, peak_mapped = phys, mapped
        proc.send("finish")
        # The rows are unmapped again, but for the bridge's spare pages per layer, once they
        # stayed spare for the unmap grace (the background mapper does it; the rank publishes
        # every second); their handles may be kept (physical) for the next map.
        spare = DEFAULT_POOL_OPTIONS["max_spare_pages"] * len(rig.RATIOS) * DEFAULT_GRANULARITY
        deadline = time.monotonic() + 10
        while True:
            phys, mapped, occ, head = swa()
            if mapped <= idle_mapped + spare or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert occ == 0 and idle_mapped <= mapped <= idle_mapped + spare < peak_mapped
        assert idle_phys <= phys <= peak
        assert (head - idle_head) * 2**30 == phys - idle_phys
    finally:
        proc.close()


@pytest.mark.parametrize(
    ("switch", "slack", "compacts"),
    [("", "0", True), ("0", "0", False), ("", "1", True), ("", "1024", False)],
)
def test_the_plugin_compacts_a_fragmented_bridged_pool_when_idle(
    snapdir: Path, switch: str, slack: str, compacts: bool
) -> None:
    """Requests of 8 SGLang pages each, every other one finished: the held rows are spread
    over twice the pages they need. The plugin's idle hook compacts (the production policy,
    kvledger.engines.sglang.bridge.compact_policy) until the mapped pages are within the packing
    bound; KVLEDGER_SGLANG_DSV4_COMPACT=0 leaves them, and so does a slack wider than the
    excess (KVLEDGER_SGLANG_DSV4_COMPACT_SLACK); a narrower one compacts back to the bound."""
    env = _env(
        KVLEDGER_SGLANG="1",
        KVLEDGER_SGLANG_DSV4_BRIDGE="1",
        KVLEDGER_SNAPSHOT_DIR=str(snapdir),
        KVLEDGER_SGLANG_DSV4_COMPACT=switch,
        KVLEDGER_SGLANG_DSV4_COMPACT_SLACK=slack,
    )
    proc = Proc(env, "--build", "--swa-pages", "256", "--full-pages", "320")
    try:
        assert proc.first["bridged"] is True, proc.first["reason"]
        for _ in range(24):
            proc.send(f"prefill {8 * 256}")
        step = proc.send("finish_every_other")
        # over the bound by more than the slack "1", less than the slack "1024"
        assert 1 < step["compaction"]["excess_pages"] < 1024, step
        phys_before = step["totals"]["physical_bytes"]
        step = proc.send("idle")
        c = step["compaction"]
        if not compacts:
            assert c["rows_moved"] == 0 and c["compaction_runs"] == 0
            assert c["excess_pages"] > 0
        else:
            assert c["rows_moved"] > 0 and c["compaction_runs"] >= 1
            assert c["excess_pages"] <= 0, c
            assert step["totals"]["physical_bytes"] < phys_before
            (rec,) = step["reconciliation"]
            assert rec["unattributed_bytes"] == 0
            again = proc.send("idle")["compaction"]  # not due any more: a count, no moves
            assert again["rows_moved"] == c["rows_moved"]
            assert again["compaction_steps"] == c["compaction_steps"] + 1
        assert step["swa_free_pages"] == step["swa_pages"] - 12 * 8
    finally:
        proc.close()


# -- exit paths -----------------------------------------------------------------------------------
def test_scheduler_exit_removes_the_file_and_the_exporter_forgets_it(
    snapdir: Path, exporter: ServeProcess
) -> None:
    proc = Proc(_env(KVLEDGER_SGLANG="1", KVLEDGER_SNAPSHOT_DIR=str(snapdir)), "--build")
    try:
        assert any(n == HEADLINE for n, _, _ in scrape(exporter.url))
        out = proc.send("exit")  # SGLang's graceful path: Scheduler.release_host_resources
        assert out == {"file_exists": False, "rank": True}
        assert list(snapdir.iterdir()) == []
        assert not any(n == HEADLINE for n, _, _ in scrape(exporter.url))
        proc.send("quit", answer=False)
        assert proc.wait() == 0
    finally:
        proc.close()


def test_normal_process_exit_removes_the_file_through_atexit(snapdir: Path) -> None:
    proc = Proc(_env(KVLEDGER_SGLANG="1", KVLEDGER_SNAPSHOT_DIR=str(snapdir)), "--build")
    assert Path(proc.first["file"]).exists()
    proc.send("quit", answer=False)
    assert proc.wait() == 0
    assert list(snapdir.iterdir()) == []


def test_sigkill_leaves_the_file_and_the_exporter_reports_it_stale(
    snapdir: Path, exporter: ServeProcess
) -> None:
    proc = Proc(_env(KVLEDGER_SGLANG="1", KVLEDGER_SNAPSHOT_DIR=str(snapdir)), "--build")
    proc.send("kill", answer=False)
    assert proc.wait() == -9
    assert Path(proc.first["file"]).exists()  # nothing runs on SIGKILL
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(exporter.url)
        up = [v for n, lb, v in samples if n == "kvledger_up"]
        if up == [0.0] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert up == [0.0]  # the pid is gone: stale, not served as live
    assert not any(n == HEADLINE for n, _, _ in samples)


def test_a_kvledger_failure_is_one_log_line_and_sglang_carries_on(snapdir: Path) -> None:
    # A snapshot directory that cannot be created: the publisher fails inside the hook.
    blocker = snapdir / "file"
    blocker.write_text("")
    env = _env(KVLEDGER_SGLANG="1", KVLEDGER_SNAPSHOT_DIR=str(blocker / "sub"))
    proc = Proc(env, "--build")
    try:
        assert proc.first["file"] is None and proc.first["labels"] is None
        assert proc.first["index_translator"] == "KVIndexTranslator"  # SGLang went on
        proc.send("quit", answer=False)
        assert proc.wait() == 0
        lines = [ln for ln in proc.stderr.splitlines() if "kvledger" in ln and "failed" in ln]
        assert len(lines) == 1 and "kvledger is off in this process" in lines[0], lines
    finally:
        proc.close()


def test_a_malformed_compaction_slack_is_one_log_line_naming_it(snapdir: Path) -> None:
    env = _env(
        KVLEDGER_SGLANG="1",
        KVLEDGER_SNAPSHOT_DIR=str(snapdir),
        KVLEDGER_SGLANG_DSV4_COMPACT_SLACK="lots",
    )
    proc = Proc(env, "--build")
    try:
        assert proc.first["file"] is None  # nothing published, nothing left behind
        assert proc.first["index_translator"] == "KVIndexTranslator"  # SGLang went on
        proc.send("quit", answer=False)
        assert proc.wait() == 0
        lines = [ln for ln in proc.stderr.splitlines() if "kvledger" in ln and "failed" in ln]
        assert len(lines) == 1 and "KVLEDGER_SGLANG_DSV4_COMPACT_SLACK='lots'" in lines[0]
        assert "kvledger is off in this process" in lines[0]
        assert list(snapdir.iterdir()) == []
    finally:
        proc.close()


def test_require_makes_a_kvledger_failure_fail_start_up(snapdir: Path) -> None:
    blocker = snapdir / "file"
    blocker.write_text("")
    env = _env(
        KVLEDGER_SGLANG="1", KVLEDGER_SGLANG_REQUIRE="1", KVLEDGER_SNAPSHOT_DIR=str(blocker / "x")
    )
    with pytest.raises(AssertionError, match=r"NotADirectoryError|FileExistsError"):
        Proc(env, "--build")
