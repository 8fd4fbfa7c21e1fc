"""YAML read as exporter-toolkit's strict reader reads it, within bounds: every refusal one
line with a position, quoting none of the text. (The same refusals through
`--web.config.file`: tests/exporter/server/test_webconfig_hostile.py.)"""

from __future__ import annotations

import pytest

from exporter.server.strict_yaml import StrictYamlError, parse


def _refusal(text: str | bytes, max_depth: int = 32, **kw: object) -> str:
    data = text.encode() if isinstance(text, str) else text
    with pytest.raises(StrictYamlError) as e:
        parse(data, max_depth=max_depth, **kw)  # type: ignore[arg-type]
    message = str(e.value)
    assert "\n" not in message and "\r" not in message, message
    return message


def test_a_document_within_the_bounds_is_read():
    assert parse(b"a: {b: [1, 2]}\nc: true\n", max_depth=4) == {"a": {"b": [1, 2]}, "c": True}
    assert parse(b"", max_depth=1) is None
    assert parse(b"x: " + b"[" * 4 + b"]" * 4, max_depth=5) == {"x": [[[[]]]]}


@pytest.mark.parametrize(
    "text",
    ["[" * 1000, "{a: " * 2000, "".join(" " * i + f"k{i}:\n" for i in range(300)), "- " * 2000],
    ids=["brackets", "flow-maps", "block-maps", "block-seqs"],
)
def test_nesting_past_the_bound_is_refused_before_recursing(text):
    assert _refusal(text).startswith("nested deeper than 32 levels at line ")


def test_the_bound_is_the_callers():
    nested = "x: " + "[" * 4 + "]" * 4
    assert _refusal(nested, max_depth=4) == "nested deeper than 4 levels at line 1 column 7"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: 1\na: 2\n", "duplicate key 'a' at line 2 column 1"),
        ("top: {k: 1, k: 2}\n", "duplicate key 'k' at line 1 column 13"),
    ],
)
def test_a_key_twice_in_one_mapping_is_refused(text, message):
    assert _refusal(text) == message + " (exporter-toolkit's strict YAML refuses it too)"


def test_a_duplicate_key_is_shown_as_the_caller_shows_it():
    message = _refusal("secret: 1\nsecret: 2\n", show=lambda key: "<hidden>")
    assert message.startswith("duplicate key <hidden> at line 2") and "secret" not in message


def test_keys_equal_in_python_but_of_other_types_are_two_keys():
    # Not refused: two keys in YAML (and in exporter-toolkit's Go), one in a Python dict.
    assert parse(b"{1: a, true: b}", max_depth=2) == {1: "b"}


def test_merge_keys_and_collection_keys_are_refused():
    merge = _refusal("base: &b {k: 1}\nother: {<<: *b}\n")
    assert merge == "merge key '<<' is not supported at line 2 column 9"
    assert _refusal("? [a, b]\n: c\n") == "a sequence as a key at line 1 column 3; keys are names"
    assert _refusal("? {a: b}\n: c\n").startswith("a mapping as a key at line 1 column 3")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: 2020-13-45\n", "a value out of range at line 1 column 4"),
        ("a: " + "1" * 5000 + "\n", "a value out of range at line 1 column 4"),
        ("a: [\n", "invalid YAML at line 2 column 1"),
        ("a: 1\n---\nb: 2\n", "invalid YAML at line 2 column 1"),
    ],
    ids=["month-13", "int-5000-digits", "unclosed", "two-documents"],
)
def test_what_pyyaml_cannot_read_or_build_is_refused_without_its_text(text, message):
    assert _refusal(text) == message


def test_text_that_is_not_utf8_is_refused():
    assert _refusal(b"a: \xff\n") == "not UTF-8 text, expected YAML"
