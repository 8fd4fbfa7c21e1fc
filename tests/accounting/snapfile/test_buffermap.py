"""accounting.snapfile.buffermap: the buffer rows, checked when the buffer map is asked for; a
failure there is that buffer map's only."""

from __future__ import annotations

import json

import pytest

from accounting.figures import Figures
from accounting.snapfile.buffermap import buffer_map
from accounting.snapfile.summary import summary_of
from tests.accounting.snapfile.files import copy_of, file_bytes, load_s, rows_refused


def test_the_first_line_gives_what_a_scrape_reads_and_the_rows_round_trip(published):
    envelope, rows, snap = published
    head = load_s(file_bytes(envelope, rows), envelope["published_at"])
    assert head.envelope.source == "s" and head.envelope.interval == 1.0
    assert head.summary == summary_of(snap)
    assert head.rows == json.dumps(rows).encode()  # kept, not parsed
    whole = buffer_map(head)
    assert whole.to_dict() == snap.to_dict()


def test_the_buffer_rows_are_not_parsed_atload_s(published):
    envelope, _ = copy_of(published)
    head = load_s(file_bytes(envelope, b"[" * 200_000 + b"not json"))
    assert head.summary.totals == Figures.of(envelope["snapshot"]["totals"])
    e = rows_refused(file_bytes(envelope, b"[" * 200_000 + b"]" * 200_000))
    assert e.detail.startswith("nesting:")
    assert rows_refused(file_bytes(envelope, b"\xff")).detail.startswith("parse:")


def test_rows_that_disagree_with_the_first_line_fail_the_buffer_map_only(published):
    envelope, rows = copy_of(published)
    for r in rows:
        r["physical_bytes"] = r["mapped_bytes"] = 80 << 30
    head = load_s(file_bytes(envelope, rows))
    assert head.summary.totals == Figures.of(envelope["snapshot"]["totals"])  # what is exported
    e = rows_refused(file_bytes(envelope, rows))
    assert "physical_bytes: the rows sum to" in e.detail
    envelope, rows = copy_of(published)
    envelope["snapshot"]["violations"].append({"subject": "a", "relation": "b", "detail": "c"})
    assert "listed in the first line, not found" in rows_refused(file_bytes(envelope, rows)).detail


@pytest.mark.parametrize(
    "key, value",
    [
        ("physical_bytes", float("nan")),
        ("physical_bytes", -4096),
        ("occupied_slots", "12"),
        ("owner", "nobody"),
        ("owner", ["vmm"]),
        ("shape", [[[1]]]),
        ("layer", True),
    ],
)
def test_bad_buffer_rows_fail_the_buffer_map_naming_the_field(published, key, value):
    envelope, rows = copy_of(published)
    rows[0][key] = value
    e = rows_refused(file_bytes(envelope, rows))
    assert e.detail.startswith("schema: buffers[0]") and key in e.detail


def test_missing_keys_in_the_rows_are_named(published):
    envelope, rows = copy_of(published)
    del rows[1]["account"]
    e = rows_refused(file_bytes(envelope, rows))
    assert "buffers[1]" in e.detail and "'account'" in e.detail
