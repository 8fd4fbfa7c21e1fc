from __future__ import annotations

import pytest

from kvledger.dashboards import yamlfile


def test_scalars_are_plain_only_when_yaml_reads_them_back_the_same():
    text = yamlfile.dump(
        {
            "plain": "sglang:kv_cache_physical_bytes",
            "duration": "5m",
            "number_like": "0.9",
            "int_like": "10",
            "sexagesimal": "1:30",
            "bool_like": "yes",
            "quoted": 'a{b="c"} > 0',
            "both_quotes": 'it\'s "x"',
            "count": 3,
            "ratio": 0.5,
            "flag": True,
        }
    )
    assert text.splitlines() == [
        "plain: sglang:kv_cache_physical_bytes",
        "duration: 5m",
        "number_like: '0.9'",
        "int_like: '10'",
        "sexagesimal: '1:30'",
        "bool_like: 'yes'",
        "quoted: 'a{b=\"c\"} > 0'",
        'both_quotes: "it\'s \\"x\\""',
        "count: 3",
        "ratio: 0.5",
        "flag: true",
    ]


def test_nesting_and_blocks():
    text = yamlfile.dump({"groups": [{"name": "g", "rules": [{"expr": "a\n  / b"}]}]}, header="h")
    assert (
        text
        == "# h\ngroups:\n  - name: g\n    rules:\n      - expr: |-\n          a\n            / b\n"
    )


@pytest.mark.parametrize("bad", [{}, [], {"a": object()}, {1: "x"}])
def test_rejects_what_it_cannot_write(bad):
    with pytest.raises((TypeError, ValueError), match="yamlfile"):
        yamlfile.dump(bad)
