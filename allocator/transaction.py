"""Work done one step at a time that stands whole or not at all: each step records its undo.

    with Transaction() as t:
        handle = backend.create(size)
        t.append(backend.release, handle)
        backend.map(address, size, handle)
        t.append(backend.unmap, address, size)
        t.commit()

A step appends its undo once it has happened. Leaving the block without `commit()` (an
exception, or a return before it) runs the undo steps, the latest first. An undo step that
fails does not stop the others and is not raised: the error that stopped the work is the one
worth reading. `undo_errors` keeps what the undo steps raised, for a caller that counts them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Transaction:
    __slots__ = ("_undo", "undo_errors")

    def __init__(self) -> None:
        self._undo: list[tuple[Callable[..., object], tuple[Any, ...]]] = []
        self.undo_errors: list[Exception] = []

    def append(self, undo: Callable[..., object], *args: Any) -> None:
        """Record how to undo the step just done: `undo(*args)`."""
        self._undo.append((undo, args))

    def commit(self) -> None:
        """Keep every step done: nothing is undone when the block ends."""
        self._undo.clear()

    def rollback(self) -> None:
        """Undo every step not committed, the latest first (also what leaving the block does)."""
        steps, self._undo = self._undo, []
        for undo, args in reversed(steps):
            try:
                undo(*args)
            except Exception as e:  # the next undo steps still run
                self.undo_errors.append(e)

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, *exc: object) -> None:
        self.rollback()
