"""YAML for the rule files, written by PyYAML: block style, multi-line strings as literal blocks.

Every string reads back (with any YAML reader) as the very same string: PyYAML
quotes a string whenever a plain scalar would resolve to something else, and the
dumper below also treats YAML 1.2 numbers (`1e100`, `.inf`), which PyYAML's YAML
1.1 resolver reads as strings but Prometheus's Go reader does not, as needing
quotes. A string spanning lines is a literal block (`|`, with the chomping and
indentation indicators PyYAML picks for trailing newlines and leading spaces)
where YAML allows one, else double-quoted.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

_YAML12_NUMBER = re.compile(
    r"""^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)
        |0o[0-7]+|0x[0-9a-fA-F]+)$""",
    re.X,
)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that indents list items under their key and quotes YAML 1.2 numbers."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


_Dumper.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_NUMBER, list("-+.0123456789"))


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(value: Any, *, header: str = "") -> str:
    """`value` as a YAML document, after `header` written as `#` comment lines."""
    try:
        body = yaml.dump(
            value,
            Dumper=_Dumper,
            sort_keys=False,
            default_flow_style=False,
            allow_unicode=True,
            width=2**31,  # one line per scalar: no folding
        )
    except yaml.representer.RepresenterError as e:
        raise TypeError(f"yamlfile: cannot write {e}") from None
    comments = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    return comments + body
