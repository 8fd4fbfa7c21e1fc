"""`kvledger bench sglang --part serving`: the trace, the host device model, and a tiny run."""

from __future__ import annotations

import argparse
import threading
import time

import pytest

from kvledger.tools.bench import sglang as bench
from kvledger.tools.bench import sglang_serving as serving

TINY = [
    "--part", "serving", "--layers", "2", "--serving-rounds", "2", "--serving-steps", "15",
    "--serving-forward-ms", "2", "--serving-compaction", "0,off", "--serving-rate", "0.5",
    "--serving-prompt-median", "300", "--serving-output-median", "12",
    "--serving-swa-pages", "256", "--serving-full-pages", "1024",
]  # fmt: skip


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(argv)


def test_the_trace_is_the_same_for_the_same_seed_and_within_its_bounds() -> None:
    spec = serving.TraceSpec(steps=400, seed=3)
    a, b = serving.make_trace(spec), serving.make_trace(spec)
    assert a == b and len(a) > 50
    assert [t.arrival for t in a] == sorted(t.arrival for t in a)
    for t in a:
        shared = serving.prefix_tokens(spec, t.group) if t.group >= 0 else 0
        assert shared % 256 == 0
        assert spec.prompt_min <= t.prompt - shared <= spec.prompt_max
        assert spec.output_min <= t.output <= spec.output_max
    assert any(t.group >= 0 for t in a) and any(t.group < 0 for t in a)
    assert serving.make_trace(serving.TraceSpec(steps=400, seed=4)) != a


def test_the_host_device_orders_reads_and_fences_behind_the_forwards_launched() -> None:
    dev = serving.HostDevice()
    log = serving.WaitLog()
    log.owner = threading.get_ident()
    reader = serving.ModelReader(dev, log)
    try:
        import torch

        first = reader.read_many([(torch.tensor([1, 2]), None)])
        assert first.ready()  # nothing launched before it
        assert first.lists() == [[1, 2]] and log.waits == 0
        n = dev.launch(0.05)
        read = reader.read_many([(torch.tensor([3]), None)])
        fence = reader.fence_now()
        assert not read.ready() and not fence.done()
        t0 = time.perf_counter()
        assert read.lists() == [[3]]  # blocks until the forward has run
        assert time.perf_counter() - t0 > 0.02
        assert dev.done(n) and fence.done()
        assert log.waits == 1 and log.kinds == {"read": 1} and reader.waits == 1
        fence.wait()  # done: no wait
        assert log.waits == 1
    finally:
        dev.close()


@pytest.mark.sglang
def test_a_tiny_serving_run_reports_every_field_and_the_same_tokens() -> None:
    args = _args(TINY)
    bench.cases.apply_defaults(args)
    r = serving.run_serving(args)
    assert r["config"]["device"] == "cpu" and r["config"]["trace"].startswith("lognormal-chat")
    runs = r["runs"]
    assert [(x["forward_ms"], x["compaction"]) for x in runs] == [(2.0, "slack 0"), (2.0, "off")]
    for run in runs:
        assert run["same_tokens"] is True and run["tokens"] > 0
        for name in ("tokens_per_s", "steps_per_s"):
            ci = run["paired"][name]
            assert ci["n"] == 2 and ci["low"] <= ci["median"] <= ci["high"]
        for k in ("native", "bridged"):
            v = run[k]
            assert v["host_us"]["n"] == 2 * 15
            assert v["blocked_us"]["median"] >= 0 and v["waits_per_1000_steps"] >= 0
            assert v["loop_wait_ms"] >= 0
        assert run["native"]["waits_per_1000_steps"] == 0  # native SGLang makes none here
        assert run["swa_memory"]["samples"] == 2 * 15
        assert 0 < run["swa_memory"]["physical_per_native"]["mean"] <= 1.5
        assert run["bound"]["samples"] == 2 * 15
        assert "compactions_per_1000_steps" in run["bridged"]
    off = runs[1]
    assert off["bridged"]["rows_moved"] == 0 and off["bridged"]["waits_per_1000_steps"] == 0
    lines = serving.report(r)
    assert any("same tokens native/bridged: True" in x for x in lines)
