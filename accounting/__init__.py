"""The ledger: four figures of KV-cache memory kept separately, per buffer.

Imports neither ``allocator`` nor ``exporter``; both depend on this package.

The names below are imported on first use (a module `__getattr__`), so importing one light
module of the package (`accounting.switches`, read by SGLang's plugin entry point in every
SGLang process) does not import the ledger.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accounting.events import PoolEvent, PoolObserver
    from accounting.figures import FIGURES, Figure, figure
    from accounting.ledger import Account, Ledger
    from accounting.snapshot import Snapshot

_HOME = {
    "FIGURES": "accounting.figures",
    "Account": "accounting.ledger",
    "Figure": "accounting.figures",
    "Ledger": "accounting.ledger",
    "PoolEvent": "accounting.events",
    "PoolObserver": "accounting.events",
    "Snapshot": "accounting.snapshot",
    "figure": "accounting.figures",
}

__all__ = [
    "FIGURES",
    "Account",
    "Figure",
    "Ledger",
    "PoolEvent",
    "PoolObserver",
    "Snapshot",
    "figure",
]


if not TYPE_CHECKING:  # type checkers see the imports above, and flag a name not among them

    def __getattr__(name: str) -> Any:
        home = _HOME.get(name)
        if home is None:
            raise AttributeError(f"module 'accounting' has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        globals()[name] = value
        return value
