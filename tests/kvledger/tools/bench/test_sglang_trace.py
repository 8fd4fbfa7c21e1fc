"""The serving loop's request trace, `lognormal-chat` (`kvledger.tools.bench.sglang_trace`)."""

from __future__ import annotations

from kvledger.tools.bench import sglang_trace as trace


def test_the_trace_is_the_same_for_the_same_seed_and_within_its_bounds() -> None:
    spec = trace.TraceSpec(steps=400, seed=3)
    a, b = trace.make_trace(spec), trace.make_trace(spec)
    assert a == b and len(a) > 50
    assert [t.arrival for t in a] == sorted(t.arrival for t in a)
    for t in a:
        shared = trace.prefix_tokens(spec, t.group) if t.group >= 0 else 0
        assert shared % 256 == 0
        assert spec.prompt_min <= t.prompt - shared <= spec.prompt_max
        assert spec.output_min <= t.output <= spec.output_max
    assert any(t.group >= 0 for t in a) and any(t.group < 0 for t in a)
    assert trace.make_trace(trace.TraceSpec(steps=400, seed=4)) != a
