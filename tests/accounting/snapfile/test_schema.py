"""accounting.snapfile.schema.parse_json: orjson's speed, the standard library's verdicts."""

from __future__ import annotations

import json
import math

import pytest

from accounting.snapfile.format import Refused
from accounting.snapfile.schema import parse_json
from tests.accounting.snapfile.files import file_bytes


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
