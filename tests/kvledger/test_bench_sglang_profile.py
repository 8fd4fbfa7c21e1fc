"""`kvledger.bench.sglang_profile`: each case profiled on the native and the bridged engine."""

from __future__ import annotations

import io

import pytest

from kvledger.bench import sglang_profile

SMALL = [
    "--requests", "40", "--prompt", "300", "--decode-tokens", "16", "--layers", "2",
    "--swa-pages", "128", "--steps", "3", "--trips", "2", "--churn-round", "10",
    "--profile-rounds", "2", "--warm-rounds", "1", "--top", "5",
]  # fmt: skip


def test_bad_counts_are_refused_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        sglang_profile.main(["--profile-rounds", "0"])
    assert e.value.code == 2
    assert "--profile-rounds=0" in capsys.readouterr().err


@pytest.mark.sglang
@pytest.mark.parametrize("case", sglang_profile.CASES)
def test_each_case_profiles_both_engines_timed_rounds_only(case: str) -> None:
    args = sglang_profile.parser().parse_args([*SMALL, "--case", case, "--churn-gap-ms", "20"])
    out = io.StringIO()
    got = sglang_profile.run(args, out)
    assert {k: len(v) for k, v in got["seconds"].items()} == {"native": 2, "bridged": 2}
    bridged, native = got["rows"]["bridged"], got["rows"]["native"]
    # Only the bridged engine's rounds ran the bridge's hooks (on this thread; from Python
    # 3.12 the profile also sees other threads, such as the bridged pool's mapper, whose
    # calls may fall in a native round); both ran SGLang's allocator.
    hooks = "kvledger/sglang/bridge/allocator_hooks.py"
    assert any(n.startswith(hooks) for n in bridged)
    assert not any(n.startswith(hooks) for n in native)
    assert any("sglang/srt/mem_cache/allocator" in n for n in native)
    if case == "churn":  # the pauses (20 ms after each of 10 events) are not timed
        assert max(got["seconds"]["native"]) < 10 * 0.020
        assert not any("time.sleep" in n for n in bridged)
    text = out.getvalue()
    for title in ("== native: own time", "== bridged - native, own time", "cumulative time"):
        assert title in text
