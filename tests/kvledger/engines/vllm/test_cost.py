"""The cost mode (kvledger/engines/vllm/cost.py) without vLLM: the timers' arithmetic, the
instrumented patches on stand-in classes, the file written at idle, and the directory and
file rules (a link at the output path is refused, never followed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvledger.engines.vllm import cost
from kvledger.engines.vllm.occupancy import EvictableCounter
from kvledger.engines.vllm.patch import MethodPatch, is_patched

ROOT = Path(__file__).resolve().parents[4]


def _spin(ns: int) -> None:
    end = time.perf_counter_ns() + ns
    while time.perf_counter_ns() < end:
        pass


@pytest.fixture
def cost_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    d = tmp_path / "cost"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("KVLEDGER_VLLM_COST_DIR", str(d))
    yield d
    cost.close()


# -- the directory ---------------------------------------------------------------------------
def test_an_unset_directory_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVLEDGER_VLLM_COST_DIR", raising=False)
    with pytest.raises(ValueError, match="KVLEDGER_VLLM_COST_DIR is unset"):
        cost.instrument([], step_class=_Core)


def test_a_missing_directory_is_named_not_created(tmp_path: Path) -> None:
    gone = tmp_path / "nope"
    with pytest.raises(ValueError, match=r"KVLEDGER_VLLM_COST_DIR='.*nope': no such directory"):
        cost.Meter(str(gone))
    assert not gone.exists()


def test_a_linked_directory_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(ValueError, match=r"KVLEDGER_VLLM_COST_DIR=.*symbolic link"):
        cost.Meter(str(tmp_path / "link"))


def test_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(ValueError, match=r"KVLEDGER_VLLM_COST_DIR=.*writable by others"):
        cost.Meter(str(d))


# -- the file --------------------------------------------------------------------------------
def _recorded(m: cost.Meter, steps: int = 1) -> None:
    for _ in range(steps):
        m.add_step(1000, True)
        m.hooks["schedule"].add(300, 200)


def test_the_file_is_written_once_a_step_ran_and_read_back(cost_dir: Path) -> None:
    m = cost.Meter(str(cost_dir), pid=4242)
    assert not m.flush(idle=True)  # nothing recorded: no file
    assert list(cost_dir.iterdir()) == []
    _recorded(m, 3)
    m.hooks["has_requests"].add(50, 20)
    assert m.flush(idle=True)
    path = cost_dir / "vllm-cost-4242.json"
    data = cost.read(str(path))
    assert (data["steps"], data["steps_executed"], data["step_ns"]) == (3, 3, 3000)
    assert data["hooks"]["schedule"] == {
        "calls": 3,
        "ns": 300,
        "max_ns": 100,
        "vllm_ns": 600,
        "gc_ns": 0,
        "cpu_ns": 0,
        "hist_log2_ns": [0] * 7 + [3],  # 100 ns: 64..127
    }
    assert (data["hook_ns"], data["hook_calls"], data["hook_max_ns"]) == (330, 4, 100)
    assert data["idle"] is True and data["writes"] == 1
    assert data["timer_ns"] is not None and data["timer_ns"] > 0
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    assert not m.flush(idle=True)  # no step since: not written again
    _recorded(m)
    assert m.flush(idle=True)
    assert cost.read(str(path))["steps"] == 4 and cost.read(str(path))["writes"] == 2
    m.close()
    m.close()
    assert [p.name for p in cost_dir.iterdir()] == ["vllm-cost-4242.json"]  # no temporaries


def test_a_link_at_the_output_path_is_refused_not_followed(cost_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("precious")
    link = cost_dir / "vllm-cost-7.json"
    link.symlink_to(target)
    m = cost.Meter(str(cost_dir), pid=7)
    _recorded(m)
    assert not m.flush(idle=True)
    assert "symbolic link" in m.broken and "refusing" in m.broken
    assert target.read_text() == "precious"
    assert link.is_symlink() and os.readlink(link) == str(target)
    _recorded(m)
    assert not m.flush(idle=True)  # stopped for good
    m.close()
    assert target.read_text() == "precious"
    with pytest.raises(OSError):
        cost.read(str(link))  # the reader does not follow it either


def test_a_dangling_link_at_the_output_path_is_refused(cost_dir: Path, tmp_path: Path) -> None:
    (cost_dir / "vllm-cost-8.json").symlink_to(tmp_path / "would-be-created")
    m = cost.Meter(str(cost_dir), pid=8)
    _recorded(m)
    assert not m.flush(idle=True)
    assert not (tmp_path / "would-be-created").exists()


def test_a_file_already_there_is_not_overwritten(cost_dir: Path) -> None:
    (cost_dir / "vllm-cost-9.json").write_text("someone else's")
    m = cost.Meter(str(cost_dir), pid=9)
    _recorded(m)
    assert not m.flush(idle=True)
    assert "regular file" in m.broken
    assert (cost_dir / "vllm-cost-9.json").read_text() == "someone else's"


def test_a_file_replaced_after_the_first_write_is_refused(cost_dir: Path, tmp_path: Path) -> None:
    m = cost.Meter(str(cost_dir), pid=10)
    _recorded(m)
    assert m.flush(idle=True)
    path = cost_dir / "vllm-cost-10.json"
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere")
    _recorded(m)
    assert not m.flush(idle=True)
    assert "replaced by a symbolic link" in m.broken
    assert not (tmp_path / "elsewhere").exists()


def test_read_refuses_what_is_not_a_cost_file(tmp_path: Path) -> None:
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a kvledger vLLM cost file"):
        cost.read(str(p))


# -- the timers ------------------------------------------------------------------------------
def test_a_timed_hook_splits_kvledger_from_vllm() -> None:
    meter = cost.Totals()
    meter.in_step = True

    def make(original: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            out = original(*args)
            _spin(2_000_000)  # kvledger's work: 2 ms
            return out

        return wrapper

    def vllm_method(x: int) -> int:
        _spin(20_000_000)  # vLLM's: 20 ms
        return x + 1

    seen: list[Any] = []
    fn = cost.timed_hook(make, meter, "schedule", seen.append)(vllm_method)
    assert fn(1) == 2 and seen == [2]
    totals = meter.hooks["schedule"]
    assert meter.outside.calls == 0
    assert totals.calls == 1
    assert 2_000_000 <= totals.ns < 15_000_000, totals.ns  # not vLLM's 20 ms
    assert totals.vllm_ns >= 20_000_000, totals.vllm_ns
    assert totals.max_ns == totals.ns


def test_a_failing_call_is_still_counted_and_outside_a_step_apart() -> None:
    meter = cost.Totals()

    def boom() -> None:
        raise KeyError("vllm")

    fn = cost.timed_hook(lambda original: original, meter, "has_requests")(boom)
    with pytest.raises(KeyError):
        fn()
    assert meter.outside.calls == 1 and meter.hooks["has_requests"].calls == 0


def test_a_gc_pause_inside_a_hook_is_told_apart() -> None:
    import gc

    meter = cost.Totals()
    meter.in_step = True

    def make(original: Any) -> Any:
        def wrapper() -> Any:
            gc.collect()
            return original()

        return wrapper

    with meter.gc:
        cost.timed_hook(make, meter, "schedule")(_noop)()
    t = meter.hooks["schedule"]
    assert meter.gc.count >= 1 and 0 < t.gc_ns <= t.ns


def _noop() -> None:
    return None


def test_a_part_is_told_by_thread_and_step() -> None:
    import threading

    meter = cost.Totals()
    fn = cost.timed_part(meter, "publish")(lambda: _spin(10_000))
    fn()  # before the first step: the loop is not known yet, counted on it (between steps)
    meter.loop_thread = threading.get_ident()
    meter.in_step = True
    fn()
    t = threading.Thread(target=fn)
    t.start()
    t.join()
    meter.in_step = False
    fn()
    p = meter.parts
    assert p["publish"].calls == 1 and p["publish"].ns >= 10_000
    assert p["publish_between_steps"].calls == 2 and p["publish_other_thread"].calls == 1
    refresh = cost.timed_part(meter, "refresh")(lambda: None)
    t = threading.Thread(target=refresh)
    t.start()
    t.join()
    assert p["refresh_between_steps"].calls == 1  # no other-thread total for a refresh
    assert p["publish"].cpu_ns > 0  # a spin is CPU time


def test_a_part_inside_a_part_is_timed_once() -> None:
    meter = cost.Totals()
    publish = cost.timed_part(meter, "publish")(lambda: _spin(10_000))

    def refreshing() -> None:
        _spin(10_000)
        publish()  # the ledger's event hook publishing during a refresh

    cost.timed_part(meter, "refresh")(refreshing)()
    assert meter.parts["refresh_between_steps"].calls == 1
    assert meter.parts["publish_between_steps"].calls == 0
    assert meter.part_depth == 0
    publish()
    assert meter.parts["publish_between_steps"].calls == 1


def test_calibrate_is_small_and_positive() -> None:
    ns = cost.calibrate(200)
    assert 0 < ns < 50_000


# -- instrument(): stand-ins for vLLM's Scheduler and EngineCore --------------------------------
class _Sched:
    def __init__(self) -> None:
        self.pending = 2

    def schedule(self) -> str:
        _spin(100_000)
        return "out"

    def has_requests(self) -> bool:
        return self.pending > 0


class _Core:
    def __init__(self, sched: _Sched) -> None:
        self.sched = sched
        self.step_fn = self.step  # bound after the plugins load, as vLLM's __init__ does

    def step(self) -> tuple[dict[int, Any], bool]:
        if not self.sched.has_requests():
            return {}, False
        self.sched.schedule()
        _spin(400_000)  # the model
        self.sched.pending -= 1
        return {0: "outputs"}, True


def _kvledger_like(original: Any) -> Any:
    def wrapper(self: Any, *args: Any) -> Any:
        out = original(self, *args)
        _spin(20_000)  # kvledger's own work in the wrapper
        return out

    return wrapper


def test_instrument_times_hooks_and_steps_and_writes_at_idle(cost_dir: Path) -> None:
    made = [
        MethodPatch(_Sched, "schedule", _kvledger_like),
        MethodPatch(_Sched, "has_requests", _kvledger_like),
    ]
    patches = cost.instrument(made, step_class=_Core)
    names = sorted((p.cls.__name__, p.name) for p in patches)
    assert names == [
        ("EvictableCounter", "_wrap"),
        ("Publisher", "_write_submitted"),
        ("Publisher", "publish"),
        ("Publisher", "submit"),
        ("SchedulerOccupancy", "refresh"),
        ("_Core", "step"),
        ("_Sched", "has_requests"),
        ("_Sched", "schedule"),
    ]
    try:
        for p in patches:
            p.apply()
        core = _Core(_Sched())
        while core.step_fn()[1]:  # 2 steps that ran the model, then has_requests() False
            pass
        assert not core.sched.has_requests()  # vLLM's loop asks again (has_work) and blocks
        meter = cost.meter()
        assert meter is not None
        path = cost_dir / f"vllm-cost-{os.getpid()}.json"
        data = cost.read(str(path))  # written when has_requests() answered False
        assert data["idle"] is True
        assert (data["steps"], data["steps_executed"]) == (3, 2)
        assert data["hooks"]["schedule"]["calls"] == 2
        assert data["hooks"]["has_requests"]["calls"] == 3  # in the steps
        assert data["outside_step"]["calls"] == 1  # the loop's own question
        assert data["hooks"]["schedule"]["vllm_ns"] >= 2 * 100_000
        assert data["hooks"]["schedule"]["ns"] >= 2 * 20_000
        assert data["hooks"]["has_requests"]["ns"] >= 3 * 20_000
        assert data["outside_step"]["ns"] >= 20_000
        assert data["hook_ns"] == sum(h["ns"] for h in data["hooks"].values())
        assert data["hook_ns"] <= data["step_ns"]
        assert data["step_ns"] >= 2 * 500_000
    finally:
        for p in reversed(patches):
            p.remove()
    assert not is_patched(_Core, "step") and not is_patched(EvictableCounter, "_wrap")


def test_the_evictable_counters_wrappers_are_timed(cost_dir: Path) -> None:
    patches = cost.instrument([], step_class=_Core)
    try:
        for p in patches:
            p.apply()

        class Queue:
            def popleft(self) -> str:
                _spin(50_000)
                return "block"

        q = Queue()
        holder = type("Holder", (), {"_installed": []})()

        def counting(orig: Any) -> Any:
            def popleft() -> Any:
                out = orig()
                _spin(10_000)
                return out

            return popleft

        EvictableCounter._wrap(holder, q, "popleft", counting)
        meter = cost.meter()
        assert meter is not None
        meter.in_step = True
        assert q.popleft() == "block"
        pool = meter.hooks[cost.POOL]
        assert pool.calls == 1
        assert 10_000 <= pool.ns < 50_000 and pool.vllm_ns >= 50_000
    finally:
        for p in reversed(patches):
            p.remove()


def test_a_vllm_without_a_step_is_refused(cost_dir: Path) -> None:
    class NoStep:
        pass

    with pytest.raises(ValueError, match="NoStep has none of step, step_with_batch_queue"):
        cost.instrument([], step_class=NoStep)


# -- hooks.install(): the switch, read once -------------------------------------------------
class GPUModelRunner:
    def initialize_kv_cache_tensors(self, config: Any) -> dict[str, Any]:
        return {}


class Scheduler(_Sched):
    def shutdown(self) -> None:
        pass


class EngineCore(_Core):
    pass


@pytest.mark.parametrize("on", [False, True])
def test_install_instruments_only_when_switched_on(
    on: bool, cost_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvledger.engines.vllm import compat, hooks

    monkeypatch.setattr(compat, "check", lambda: "")
    monkeypatch.setattr(hooks, "RUNNER_MODULE", __name__)
    monkeypatch.setattr(hooks, "SCHEDULER_MODULE", __name__)
    monkeypatch.setattr(cost, "ENGINE_CORE_MODULE", __name__)
    monkeypatch.setenv("KVLEDGER_VLLM_COST", "1" if on else "0")
    try:
        targets = sorted(p.target.rsplit(".", 2)[-2] + "." + p.name for p in hooks.install())
        assert ("EngineCore.step" in targets) is on
        assert ("EvictableCounter._wrap" in targets) is on
        assert "Scheduler.schedule" in targets and is_patched(Scheduler, "schedule")
        assert (cost.meter() is not None) is on
    finally:
        hooks.uninstall()
    assert not is_patched(Scheduler, "schedule") and not is_patched(EngineCore, "step")


def test_a_malformed_cost_switch_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvledger.engines.vllm import compat, hooks

    monkeypatch.setattr(compat, "check", lambda: "")
    monkeypatch.setattr(hooks, "RUNNER_MODULE", __name__)
    monkeypatch.setattr(hooks, "SCHEDULER_MODULE", __name__)
    monkeypatch.setenv("KVLEDGER_VLLM_COST", "sometimes")
    try:
        with pytest.raises(ValueError, match="KVLEDGER_VLLM_COST='sometimes'"):
            hooks.install()
        assert not is_patched(Scheduler, "schedule")
    finally:
        hooks.uninstall()


def test_the_entry_point_off_imports_no_cost_module() -> None:
    code = (
        "import sys, kvledger.engines.vllm as p; p.register(); "
        "print('kvledger.engines.vllm.cost' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "KVLEDGER_VLLM_COST": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"
