"""Tensor parallelism: one SwaPool per TP rank; rank 0 decides the pages, the peers follow.

`coordinator` (the protocol and `TpCoordinator`), `exchange` (the wire: views, all_gather,
checks, errors) and `pages` (`TpPages`, the page store's side)."""

from allocator.tp.coordinator import TpCoordinator
from allocator.tp.exchange import (
    MAGIC,
    PLAN_WORDS,
    VIEW_WORDS,
    TpDivergenceError,
    TpError,
    TpPeerError,
)
from allocator.tp.pages import TpPages

__all__ = [
    "MAGIC",
    "PLAN_WORDS",
    "VIEW_WORDS",
    "TpCoordinator",
    "TpDivergenceError",
    "TpError",
    "TpPages",
    "TpPeerError",
]
