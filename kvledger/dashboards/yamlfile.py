"""A small YAML writer for the rule files: mappings, lists, strings, numbers, booleans.

Block style throughout. A string is written plain when YAML would read it back as
the same string, as a literal block (`|-`) when it spans lines, and double-quoted
(JSON escapes, which YAML accepts) otherwise. Enough for Prometheus rule files;
not a general serialiser (anything else raises).
"""

from __future__ import annotations

import json
import re
from typing import Any

_PLAIN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:/-]*$")
_RESERVED = frozenset({"true", "false", "yes", "no", "on", "off", "null", "y", "n", "~"})


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        if _plain_safe(value):
            return value
        if "'" not in value and value.isprintable():
            return "'" + value + "'"
        return json.dumps(value)
    raise TypeError(f"yamlfile: cannot write {type(value).__name__} {value!r}")


def _plain_safe(value: str) -> bool:
    """True when YAML reads `value` written plain back as this very string."""
    if not _PLAIN.match(value) or value.lower() in _RESERVED:
        return False
    if value[0].isdigit():
        if ":" in value:  # YAML 1.1 reads 1:30 as a sexagesimal number
            return False
        try:
            float(value)
        except ValueError:
            pass
        else:
            return False
        try:
            int(value, 0)
        except ValueError:
            return True
        return False
    return True


def _block(value: str, indent: int) -> str:
    pad = " " * indent
    return "|-\n" + "\n".join(pad + line if line else "" for line in value.split("\n"))


def _lines(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    out: list[str] = []
    if isinstance(value, dict):
        if not value:
            raise ValueError("yamlfile: empty mapping")
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"yamlfile: key {key!r} is not a string")
            if isinstance(item, (dict, list)):
                out.append(f"{pad}{_scalar(key)}:")
                out += _lines(item, indent + 2)
            elif isinstance(item, str) and "\n" in item:
                out.append(f"{pad}{_scalar(key)}: {_block(item, indent + 2)}")
            else:
                out.append(f"{pad}{_scalar(key)}: {_scalar(item)}")
    elif isinstance(value, list):
        if not value:
            raise ValueError("yamlfile: empty list")
        for item in value:
            sub = _lines(item, indent + 2)
            sub[0] = f"{pad}- {sub[0].lstrip()}"
            out += sub
    elif isinstance(value, str) and "\n" in value:
        raise ValueError("yamlfile: a multi-line string must be a mapping's value")
    else:
        out.append(pad + _scalar(value))
    return out


def dump(value: Any, *, header: str = "") -> str:
    """`value` as a YAML document, after `header` written as `#` comment lines."""
    comments = [f"# {line}".rstrip() for line in header.splitlines()]
    return "\n".join([*comments, *_lines(value, 0)]) + "\n"
