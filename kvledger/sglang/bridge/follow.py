"""The ledger's view of a followed engine pool: rows held, counted in tokens.

The bridge follows SGLang's SWA pages with allocator.rows' `RowFollower` (one engine
page is one row). The ledger counts the SWA family in tokens (as SGLang's allocator
reports its capacity), so `TokenObserver` scales the store's row figures by `page_size`.
"""

from __future__ import annotations

from collections.abc import Callable

from accounting.events import PoolEvent, PoolObserver


class TokenObserver:
    """Forwards pool events to `target`, slot counts multiplied by `tokens_per_slot`."""

    def __init__(self, target: PoolObserver, tokens_per_slot: int) -> None:
        if (
            isinstance(tokens_per_slot, bool)
            or not isinstance(tokens_per_slot, int)
            or tokens_per_slot <= 0
        ):
            raise ValueError(f"tokens_per_slot={tokens_per_slot!r}, expected a positive int")
        self.target = target
        self.tokens_per_slot = tokens_per_slot

    def on_pool_event(self, event: PoolEvent, count: int, seconds: float = 0.0) -> None:
        if event in (PoolEvent.SLOTS_OCCUPIED, PoolEvent.SLOTS_FREED):
            count *= self.tokens_per_slot
        self.target.on_pool_event(event, count, seconds)

    def on_slots(self, occupied: int, peak: int) -> None:
        self.target.on_slots(occupied * self.tokens_per_slot, peak * self.tokens_per_slot)

    def attach(self, flush: Callable[[], None]) -> None:
        self.target.attach(flush)

    def detach(self, flush: Callable[[], None]) -> None:
        self.target.detach(flush)

    def at_safe_point(self) -> None:
        self.target.at_safe_point()
