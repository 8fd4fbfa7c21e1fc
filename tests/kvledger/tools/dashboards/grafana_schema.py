"""A dashboard JSON held against Grafana's published dashboard schema.

grafana-foundation-sdk (a dev dependency) is generated from the same schema as
npm's `@grafana/schema`: one Python class per schema type, with typed fields.
`problems()` decodes the JSON into those classes (panels and queries through the
SDK's registered panel and data-source variants), then reports
- every key the schema does not declare (the decoder drops it: Grafana would
  ignore or reject it), and every value the decoder reads differently;
- every field whose value does not have the declared type: enums (e.g. a
  series' drawStyle), literals, numbers, strings, lists, nested types.
"""

from __future__ import annotations

import enum
import functools
import json
import types
import typing
from typing import Any

from grafana_foundation_sdk.cog import plugins
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard

SDK_PREFIX = "grafana_foundation_sdk.models."


@functools.cache
def _registered() -> None:
    plugins.register_default_plugins()


def problems(data: dict[str, Any]) -> list[str]:
    _registered()
    decoded = Dashboard.from_json(data)
    back = json.loads(json.dumps(decoded, cls=JSONEncoder))
    out: list[str] = []
    _compare(data, back, "", out)
    _check_types(decoded, "", out)
    return out


def _compare(sent: Any, read: Any, path: str, out: list[str]) -> None:
    if isinstance(sent, dict) and isinstance(read, dict):
        for key, value in sent.items():
            if key not in read:
                out.append(f"{path}/{key}: not a field of Grafana's schema")
            else:
                _compare(value, read[key], f"{path}/{key}", out)
    elif isinstance(sent, list) and isinstance(read, list) and len(sent) == len(read):
        for i, (a, b) in enumerate(zip(sent, read, strict=True)):
            _compare(a, b, f"{path}[{i}]", out)
    elif sent != read:
        out.append(f"{path}: {sent!r} reads back as {read!r}")


def _is_model(value: Any) -> bool:
    return type(value).__module__.startswith(SDK_PREFIX) and not isinstance(value, enum.Enum)


def _check_types(obj: Any, path: str, out: list[str]) -> None:
    hints = typing.get_type_hints(type(obj))
    for name, hint in hints.items():
        value = getattr(obj, name, None)
        if value is not None:
            _check(value, hint, f"{path}/{name}", out)


def _check(value: Any, hint: Any, path: str, out: list[str]) -> None:
    if not _matches(value, hint):
        out.append(f"{path}: {value!r} is not a {hint}")
        return
    if _is_model(value):
        _check_types(value, path, out)
    elif isinstance(value, list):
        args = typing.get_args(_list_hint(hint))
        for i, item in enumerate(value):
            if _is_model(item):
                _check_types(item, f"{path}[{i}]", out)
            elif args and not _matches(item, args[0]):
                out.append(f"{path}[{i}]: {item!r} is not a {args[0]}")


def _list_hint(hint: Any) -> Any:
    """`list[X]` out of `Optional[list[X]]` (or `list[X]` itself)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        for h in typing.get_args(hint):
            if typing.get_origin(h) is list:
                return h
    return hint


def _matches(value: Any, hint: Any) -> bool:
    if hint is Any or hint is object:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if origin is list:
        return isinstance(value, list)
    if origin is dict:
        return isinstance(value, dict)
    if hint is type(None):
        return value is None
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, hint) or value in {e.value for e in hint}
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # a type form this checker does not know: accepted, not guessed at
