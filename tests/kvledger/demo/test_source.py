from __future__ import annotations

import os
import time

from accounting.buffers import Owner
from kvledger.demo.source import DemoOptions, DemoSource, default_config_path
from kvledger.demo.workload import WorkloadConfig
from kvledger.engines.sglang.dsv4 import FAMILIES


def test_packaged_config_exists():
    assert os.path.isfile(default_config_path())


def test_demo_has_seven_families_and_close_releases_everything(tmp_path):
    opts = DemoOptions(
        snapshot_dir=str(tmp_path),
        publish_interval=0.1,
        labels={"model_name": "demo-test", "tp_rank": "0"},
        workload=WorkloadConfig(rate=50, step_seconds=0.005, seed=5, max_running=8),
    )
    with DemoSource(opts) as demo:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and demo.workload.stats().get("finished", 0) < 2:
            time.sleep(0.05)
        # With the workload stopped and the mapper idle no allocator call is in flight: the
        # memfd's blocks then equal the ledger's VMM physical bytes exactly.
        demo.workload.close()
        assert demo.mapper.wait_idle(10)
        snap = demo.ledger.snapshot()
        fams = snap.rollup("family")
        assert {f for (f,) in fams} == set(FAMILIES)
        peaks = {a.family: a.peak_occupied_slots for a in snap.accounts}
        assert all(peaks[f] > 0 for f in FAMILIES), peaks
        assert snap.violations == ()
        [truth] = snap.reconciliation
        assert truth["source"] == "host_memfd" and truth["unattributed_bytes"] == 0
        assert fams[("swa_kv",)]["physical_bytes"] > 0
        assert demo.publisher is not None and os.path.exists(demo.publisher.path)
        backend = demo.backend
    assert demo.closed and backend.closed
    assert list(tmp_path.iterdir()) == []
    snap = demo.ledger.snapshot(reconcile=False)
    vmm = [b for b in snap.buffers if b.spec.owner is Owner.VMM]
    assert sum(b.physical_bytes for b in vmm) == 0
    assert sum(b.mapped_bytes for b in vmm) == 0
    assert snap.total("occupied_slots") == 0
    demo.close()  # idempotent


def test_a_failure_half_way_releases_what_was_built(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="budget_bytes"):
        DemoSource(DemoOptions(budget_bytes=1 << 20, snapshot_dir=str(tmp_path)))
    assert list(tmp_path.iterdir()) == []


def test_demo_serves_a_v41_config_with_every_family_moving(tmp_path):
    """`kvledger serve --config` with the V4.1-shaped config: the twelve families (the SWA rows
    of 528-byte tokens on the VMM pool), each occupied by the workload, all given back."""
    from tests.kvledger.engines.sglang.dsv4.fixtures import V41_CONFIG

    opts = DemoOptions(
        config_path=str(V41_CONFIG),
        snapshot_dir=str(tmp_path),
        publish_interval=0.1,
        labels={"model_name": "demo-v41", "tp_rank": "0"},
        workload=WorkloadConfig(rate=50, step_seconds=0.005, seed=5, max_running=8),
    )
    with DemoSource(opts) as demo:
        assert demo.buffer_map.kv_layout == "v41"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and demo.workload.stats().get("finished", 0) < 2:
            time.sleep(0.05)
        demo.workload.close()
        assert demo.mapper.wait_idle(10)
        snap = demo.ledger.snapshot()
        fams = {f for (f,) in snap.rollup("family")}
        assert fams == set(demo.buffer_map.families) and "c2_state" in fams
        peaks = {a.family: a.peak_occupied_slots for a in snap.accounts}
        assert all(peaks[f] > 0 for f in fams), peaks
        assert snap.violations == ()
        swa = next(a for a in snap.accounts if a.family == "swa_kv")
        assert {b.spec.slot_bytes for b in snap.buffers if b.spec.family == "swa_kv"} == {528}
        assert swa.peak_occupied_slots > 0
    assert demo.closed
