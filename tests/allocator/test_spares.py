"""SparePolicy on a bare PageStore (host backend): the order in which its trims unmap spares.
The followers' and pools' tests drive the policy through their frees."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from allocator.host import HostBackend
from allocator.states import PageState
from allocator.store import PageStore
from tests.allocator.rigs import SMALL_GRANULARITY

G = SMALL_GRANULARITY


@pytest.fixture
def store() -> Iterator[PageStore]:
    with (
        HostBackend(G) as be,
        PageStore(be, layers=2, page_bytes=G, num_pages=6, max_spare_pages=1, grace_pages=0) as s,
    ):
        yield s


def test_a_trim_unmaps_the_most_recently_emptied_spares_first(store: PageStore) -> None:
    """Pages 1, 4 and 2 empty in that order (not page id order): a trim down to the
    watermark (one spare) unmaps 2, then 4, and keeps 1, the spare that emptied first."""
    with store.lock:
        store.map_locked([1, 2, 4])
        for p in (1, 2, 4):
            store.set_use(p, True)
        for p in (1, 4, 2):
            store.set_use(p, False)
        assert list(store.spares) == [1, 4, 2]
        assert store.policy.trim_candidate(wanted=True) == 2
        store.policy.trim_locked()
        assert list(store.spares) == [1]
        assert [p for p in (1, 2, 4) if store.state[p] == PageState.UNMAPPED] == [2, 4]
