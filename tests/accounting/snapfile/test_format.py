"""accounting.snapfile.format: the file's two lines, its envelope and its source names."""

from __future__ import annotations

import json

import pytest

from accounting.snapfile.format import Refused, parse, source_id, table_of
from accounting.snapfile.writer import Publisher
from tests.ledgers import small_ledger


def test_source_id_is_file_safe_and_ordered():
    labels = {"model_name": "deepseek/V4 Flash", "tp_rank": "1", "pp_rank": "0", "dp_rank": "2"}
    assert source_id(labels, 7) == "deepseek_V4_Flash-dp2-pp0-tp1-pid7"
    assert source_id({}, 7) == "pid7"


def test_file_is_envelope_line_then_buffer_rows(tmp_path):
    with small_ledger() as sl, Publisher(sl.ledger, tmp_path, interval=1000) as pub:
        pub.publish()
        with open(pub.path, "rb") as f:
            head, rows = f.read().split(b"\n")
        envelope = json.loads(head)
        assert "buffers" not in envelope["snapshot"]
        assert {"totals", "families", "accounts", "violations"} <= set(envelope["snapshot"])
        assert [b["name"] for b in json.loads(rows)] == [
            b.spec.name for b in sl.ledger.snapshot().buffers
        ]
    with pytest.raises(ValueError, match="one line"):
        parse(b'{"kvledger_publish": 1}')
    with pytest.raises(ValueError, match="kvledger_publish"):
        parse(b'{"kvledger_publish": 99}\n[]')


def test_a_table_of_columns_holds_up_to_its_limit_of_rows():
    """`limit` is the most rows a table may have: exactly `limit` is taken, one more refused."""
    table = {"key": ["a", "b", "c"], "n": [1, 2, 3], "extra": "dropped"}
    assert table_of(table, "accounts", ("key", "n"), 3) == {"key": ["a", "b", "c"], "n": [1, 2, 3]}
    with pytest.raises(Refused) as e:
        table_of(table, "accounts", ("key", "n"), 2)
    assert (e.value.reason, e.value.detail) == ("schema", "accounts: 3 entries, expected at most 2")
