"""accounting.snapfile.schema.parse_json: orjson's speed, the standard library's verdicts."""

from __future__ import annotations

import json
import math

import pytest

from accounting.gpu_parts import PART_NAMES
from accounting.snapfile.format import Refused
from accounting.snapfile.schema import parse_json
from tests.accounting.snapfile.files import file_bytes, refused, with_snapshot


def test_a_published_first_line_parses_as_the_standard_library_reads_it(published):
    envelope, rows, _ = published
    first = file_bytes(envelope, rows).split(b"\n", 1)[0]
    assert parse_json(first) == json.loads(first)
    doc = '{"a": [1, -0, 1.5e-7, 18446744073709551615], "\\u00e9t\\u00e9": "\\ud83d\\ude00 ok"}'
    assert parse_json(doc.encode()) == json.loads(doc)


@pytest.mark.parametrize("text", [b"NaN", b"-Infinity", b"1e400", b'"\\ud800"'])
def test_what_orjson_refuses_reaches_the_schema_as_the_standard_library_reads_it(text):
    """NaN and the rest are not refused at parse: the field's checker names them."""
    got, want = parse_json(text), json.loads(text)
    assert got == want or (math.isnan(got) and math.isnan(want))


@pytest.mark.parametrize(
    "data, kind",
    [
        (b'{"a": 1', "parse"),
        (b"\xff\xfe", "parse"),
        (b"", "parse"),
        (b'{"a": 1} x', "parse"),
        (b"[" * 100_000 + b"]" * 100_000, "nesting"),
    ],
)
def test_bytes_that_are_not_json_are_refused_by_kind(data, kind):
    with pytest.raises(Refused) as e:
        parse_json(data)
    assert e.value.reason == kind and e.value.detail


def test_an_integer_beyond_64_bits_comes_back_as_a_float():
    """The one difference from the standard library: every integer field refuses it."""
    assert isinstance(parse_json(b"18446744073709551616"), float)


# -- figures no source can hold, and engine figures that disagree: issue 43 finding 5 -------------
def _nvml(**changes) -> dict:
    from accounting.reconcile import result

    entry = result(
        "nvml",
        ledger_bytes=0,
        device_bytes=0,
        basis="device",
        detail={"used_bytes": 1000},
        parts={**dict.fromkeys(PART_NAMES, 0), "other_processes": 1000},
        total_bytes=80 << 30,
    )
    parts = {**entry["parts"], **changes.pop("parts", {})}  # every part named
    return {**entry, **changes, "parts": parts}


@pytest.mark.parametrize(
    "entry, needle",
    [
        (  # every part at 2^63-1 (no used_bytes, no total: nothing else would bound them)
            _nvml(parts=dict.fromkeys(PART_NAMES, 2**63 - 1), detail={}, total_bytes=None),
            f"weights={2**63 - 1}, over the {1 << 50} bytes one source can hold",
        ),
        (
            _nvml(parts={"unattributed": -(2**63 - 1)}, detail={}, total_bytes=None),
            "unattributed=-9223372036854775807, over",
        ),
        (_nvml(ledger_bytes=2**63 - 1), "ledger_bytes=9223372036854775807, over the"),
        (_nvml(device_bytes=1 << 51), f"device_bytes={1 << 51}, over the"),
        (_nvml(total_bytes=2**63 - 1), "total_bytes=9223372036854775807, over the"),
    ],
)
def test_truth_figures_past_what_one_source_can_hold_are_refused(published, entry, needle):
    """An unattributed figure of -9.2e18 (ledger_bytes 2^63-1) or parts of 2^63-1 bytes were
    exported as figures; past 1 PiB they are refused like a total is."""
    e = refused(with_snapshot(published, reconciliation=[entry]))
    assert e.reason == "schema" and e.detail.startswith("reconciliation[0]"), e.detail
    assert needle in e.detail, e.detail


def _engine(requests, **changes) -> dict:
    from accounting.engine_state import RequestHeld, engine_state

    reqs = [RequestHeld(f"r{i}", 1, 1.0, b, by) for i, (b, by) in enumerate(requests)]
    return {**engine_state(holders_from="T", requests=reqs).to_dict(), **changes}


def _first_request(state: dict, **changes) -> dict:
    state["requests"][0].update(changes)
    return state


@pytest.mark.parametrize(
    "state, needle",
    [
        (  # a split of 10^15 for a 1,000-byte request
            _first_request(_engine([(1000, {"c4_kv": 1000})]), bytes_by_family={"c4_kv": 10**15}),
            "engine.requests[0]: bytes_by_family sum to 1000000000000000, bytes=1000",
        ),
        (  # every running request listed, their sum 1,000: request_bytes_sum 10^15
            _engine([(1000, {})], request_bytes_sum=10**15),
            "request_bytes_sum=1000000000000000, but the 1 running requests, every one listed, "
            "sum to 1000",
        ),
        (  # not all listed: the histogram (two requests of at most 1 MiB) bounds the sum
            _engine([(1000, {})], running_requests=2, request_bytes_sum=10**15)
            | {"request_bytes_counts": [2] + [0] * 9},
            "request_bytes_sum=1000000000000000, outside what request_bytes_counts allow "
            "([0, 2097152])",
        ),
        (
            _engine([(1000, {})], running_requests=2, request_bytes_sum=500)
            | {"request_bytes_counts": [2] + [0] * 9},
            "request_bytes_sum=500, less than the listed requests' 1000",
        ),
        (  # a listed request the histogram does not count
            _engine([(1000, {})]) | {"request_bytes_counts": [0, 1] + [0] * 8},
            "1 listed requests hold <= 1048576 bytes, request_bytes_counts[0]=0",
        ),
        (
            _first_request(_engine([(1000, {})]), bytes=1 << 51),
            f"engine.requests[0]: bytes={1 << 51}, over the",
        ),
    ],
)
def test_engine_figures_that_disagree_with_each_other_are_refused(published, state, needle):
    """The listed requests, the histogram and request_bytes_sum are one set of rows told
    three ways: a sum of 10^15 next to requests of 1,000 bytes was exported as truth."""
    e = refused(with_snapshot(published, engine=state))
    assert e.reason == "schema" and needle in e.detail, e.detail
