"""One method of a foreign class replaced by a wrapper, and put back.

vLLM has no hook registry: a plugin that wants to run around one of its methods sets
the class attribute itself. `MethodPatch` does that once (a second `apply` is a
no-op), keeps the original, and `remove()` restores it only if the attribute is
still kvledger's wrapper (someone who patched after us is left alone, and told).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

MARK = "__kvledger_original__"


class MethodPatch:
    """`cls.name` replaced by `make(original)`; `remove()` (idempotent) restores it."""

    def __init__(self, cls: type, name: str, make: Callable[[Callable[..., Any]], Any]) -> None:
        if not isinstance(cls, type):
            raise TypeError(f"MethodPatch: cls={cls!r}, expected a class")
        original = cls.__dict__.get(name)
        # Inherited (a base class defines it): wrapped on `cls`, and `remove` deletes it there.
        self.inherited = original is None
        if original is None:
            original = next((k.__dict__[name] for k in cls.__mro__ if name in k.__dict__), None)
        if original is None or not callable(original):
            raise AttributeError(
                f"{cls.__module__}.{cls.__qualname__}.{name}: not a method of the class, "
                "expected one kvledger can wrap"
            )
        self.cls = cls
        self.name = name
        self.original = getattr(original, MARK, original)  # already ours: wrap the real one
        self.make = make  # kept: the cost mode (cost.py) rebuilds a wrapper with timers
        wrapper = make(self.original)
        functools.update_wrapper(wrapper, self.original)
        setattr(wrapper, MARK, self.original)
        self.wrapper = wrapper
        self.applied = False

    @property
    def target(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}.{self.name}"

    def apply(self) -> None:
        if self.applied:
            return
        setattr(self.cls, self.name, self.wrapper)
        self.applied = True

    def remove(self) -> None:
        if not self.applied:
            return
        self.applied = False
        if self.cls.__dict__.get(self.name) is self.wrapper:
            if self.inherited:
                delattr(self.cls, self.name)
            else:
                setattr(self.cls, self.name, self.original)
        else:
            log.warning("kvledger: %s was re-patched by someone else; left as it is", self.target)


def is_patched(cls: type, name: str) -> bool:
    return hasattr(cls.__dict__.get(name), MARK)
