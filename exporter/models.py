"""Pydantic models (hence OpenAPI) generated from accounting's dataclasses.

The snapshot's rows are declared once, as dataclasses in `accounting`; the debug
endpoint's models are built from their fields here, so a field added, renamed or
retyped there changes the API schema with it. JSON types follow the dataclasses'
`to_dict()`: an enum becomes the literal of its values, a tuple a list. Models
forbid extra keys, so a `to_dict()` that writes a field the dataclass does not
declare fails validation instead of disappearing from the schema.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model


def json_type(tp: Any) -> Any:
    """The type `to_dict()` writes for a dataclass field of type `tp`."""
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return Literal[tuple(e.value for e in tp)]
    if origin is tuple:
        args = typing.get_args(tp)
        return list[json_type(args[0])] if args else list[Any]  # type: ignore[misc]
    if origin in (typing.Union, types.UnionType):
        members = tuple(json_type(a) for a in typing.get_args(tp))
        return typing.Union[members]  # noqa: UP007
    return tp


def model_of(
    cls: type,
    *,
    name: str,
    doc: str | None = None,
    drop: tuple[str, ...] = (),
    include: tuple[type, ...] = (),
    extra: Mapping[str, Any] | None = None,
    descriptions: Mapping[str, str] | None = None,
) -> type[BaseModel]:
    """A model with the fields of dataclass `cls` (less `drop`, private ones and those of
    `include`d dataclasses flattened in first), then `extra` ({name: type}), each with
    its description from `descriptions` (a description of no field raises)."""
    fields: dict[str, Any] = {}
    for source in (*include, cls):
        hints = typing.get_type_hints(source)
        for f in dataclasses.fields(source):
            if f.name in drop or f.name.startswith("_"):
                continue
            default = f.default if f.default is not dataclasses.MISSING else ...
            fields[f.name] = (json_type(hints[f.name]), default)
    for key, tp in (extra or {}).items():
        fields[key] = (tp, ...)
    for key, text in (descriptions or {}).items():
        if key not in fields:
            raise KeyError(
                f"{name}: description of {key!r}, which is not a field: {sorted(fields)}"
            )
        tp, default = fields[key]
        fields[key] = (tp, Field(default, description=text))
    model: type[BaseModel] = create_model(
        name,
        __doc__=doc if doc is not None else cls.__doc__,
        __config__=ConfigDict(extra="forbid"),
        **fields,
    )
    return model
