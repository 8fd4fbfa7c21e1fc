"""The ledger: four figures of KV-cache memory kept separately, per buffer.

Imports neither ``allocator`` nor ``exporter``; both depend on this package.
"""

from accounting.events import PoolEvent, PoolObserver
from accounting.figures import FIGURES, Figure, figure
from accounting.ledger import Account, Ledger
from accounting.snapshot import Snapshot

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
