"""kvledger.tools.dashboards.yamlfile: every value reads back (PyYAML's safe loader) as what was written."""

from __future__ import annotations

import pytest
import yaml

from kvledger.tools.dashboards import yamlfile

TRICKY_STRINGS = [
    "sglang:kv_cache_physical_bytes",
    "a\n  / b",  # a PromQL expression over two lines
    "trailing newline\n",
    "two trailing newlines\n\n",
    "  leading spaces\nthen text",
    "\nleading newline",
    "1e100",
    "inf",
    ".inf",
    "-.5e-3",
    "0x1f",
    "2024-01-01",
    "1:30",
    "yes",
    "null",
    "~",
    "",
    "- looks like a list",
    "# looks like a comment",
    'a{b="c"} > 0',
    'it\'s "both"',
    "tab\there",
    "line with trailing space \nnext",
    "unicode: µs ≤ 1",
]


@pytest.mark.parametrize("value", TRICKY_STRINGS)
def test_a_string_reads_back_as_the_same_string(value):
    doc = {"groups": [{"rules": [{"expr": value, "labels": {"v": value}}]}]}
    text = yamlfile.dump(doc, header="header")
    assert yaml.safe_load(text) == doc, text


def test_numbers_and_yaml_1_2_number_strings_keep_their_types():
    doc = {"count": 3, "ratio": 0.5, "flag": True, "s1": "1e100", "s2": ".inf", "s3": "10"}
    text = yamlfile.dump(doc)
    assert yaml.safe_load(text) == doc
    # A YAML 1.2 reader (Prometheus's) reads a plain 1e100 as a number: it must be quoted.
    assert "s1: '1e100'" in text and "s2: '.inf'" in text


def test_multi_line_strings_are_literal_blocks_and_the_header_is_comments():
    text = yamlfile.dump(
        {"groups": [{"name": "g", "rules": [{"expr": "a\n  / b"}]}]}, header="h\ni"
    )
    assert text == (
        "# h\n# i\ngroups:\n  - name: g\n    rules:\n      - expr: |-\n          a\n            / b\n"
    )


def test_rejects_what_it_cannot_write():
    with pytest.raises(TypeError, match="yamlfile"):
        yamlfile.dump({"a": object()})
