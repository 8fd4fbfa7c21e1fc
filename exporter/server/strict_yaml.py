"""YAML read as exporter-toolkit's strict reader reads it, within bounds.

PyYAML's safe loader, held to bounds a small config file never nears: nested at most
`max_depth` deep (checked before PyYAML's recursive composer goes a level deeper, so no depth
reaches Python's recursion limit), every key a plain scalar (a mapping or sequence as a key
is built by a recursive walk that aliases can make deep), no key twice in one mapping
(exporter-toolkit's strict YAML refuses it; PyYAML would keep the last), no merge key (`<<`,
whose chains PyYAML follows recursively). A value that PyYAML cannot build (a date of month
13, an integer of thousands of digits) is refused too. Every refusal is a `StrictYamlError`,
one line that quotes none of the text: a position is a line and a column, and a duplicate
key is shown only as the caller's `show` shows it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import yaml

_MERGE_TAG = "tag:yaml.org,2002:merge"
_VALUE_TAG = "tag:yaml.org,2002:value"


class StrictYamlError(ValueError):
    """The text is not YAML, or breaks a bound: one line, no content."""


class _Refused(Exception):
    """The document breaks a bound of `_Loader`: the refusal's words and where."""

    def __init__(self, message: str, mark: Any, hint: str = "") -> None:
        super().__init__(message)
        self.message, self.mark, self.hint = message, mark, hint


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader under the bounds of this module's docstring."""

    def __init__(self, stream: str, max_depth: int, show: Callable[[object], str]) -> None:
        super().__init__(stream)
        self._max_depth = max_depth
        self._show = show
        self._depth = 0
        self._node: Any = None  # the node being built, for the position of a ValueError

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self._depth >= self._max_depth:
            raise _Refused(
                f"nested deeper than {self._max_depth} levels", self.peek_event().start_mark
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        self._node = node
        return super().construct_object(node, deep=deep)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    raise _Refused("merge key '<<' is not supported", key_node.start_mark)
                if not isinstance(key_node, yaml.ScalarNode):
                    raise _Refused(
                        f"a {key_node.id} as a key", key_node.start_mark, "; keys are names"
                    )
                key = (
                    key_node.value
                    if key_node.tag == _VALUE_TAG
                    else self.construct_object(key_node)
                )
                if (type(key), key) in seen:  # true and 1 are two keys
                    raise _Refused(
                        f"duplicate key {self._show(key)}",
                        key_node.start_mark,
                        " (exporter-toolkit's strict YAML refuses it too)",
                    )
                seen.add((type(key), key))
        return super().construct_mapping(node, deep=deep)


def _at(mark: Any) -> str:
    return f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""


def parse(data: bytes, *, max_depth: int, show: Callable[[object], str] = repr) -> Any:
    """The single document in `data` (UTF-8); StrictYamlError (one line, no content) on any
    fault. `show` is how a refusal shows a duplicate key."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise StrictYamlError("not UTF-8 text, expected YAML") from None
    loader = _Loader(text, max_depth, show)
    try:
        return loader.get_single_data()
    except _Refused as e:
        raise StrictYamlError(f"{e.message}{_at(e.mark)}{e.hint}") from None
    except yaml.YAMLError as e:
        raise StrictYamlError(f"invalid YAML{_at(getattr(e, 'problem_mark', None))}") from None
    except (ValueError, OverflowError, TypeError):
        # A value PyYAML's constructors cannot build: a date of month 13, an integer past
        # Python's 4300 digits. Its text is not shown.
        node = loader._node
        at = _at(node.start_mark if node is not None else None)
        raise StrictYamlError(f"a value out of range{at}") from None
    except RecursionError:  # not reached (the bounds above); a last guard
        raise StrictYamlError("nested too deeply") from None
    finally:
        loader.dispose()
