"""The basic-auth check queue's share per client (`exporter.server.basicauth._CheckQueue`):
which waiting request gives up its place when the queue is full."""

from __future__ import annotations

import anyio
import pytest

from exporter.server import basicauth

pytestmark = pytest.mark.skipif(not basicauth.available(), reason="needs bcrypt (kvledger[tls])")


def test_the_newest_waiting_request_of_the_biggest_holder_gives_up_its_place():
    anyio.run(_biggest_holder_gives_up)  # cancel scopes belong to an event loop


async def _biggest_holder_gives_up() -> None:
    q = basicauth._CheckQueue()
    a = [q.enter("10.0.0.1") for _ in range(4)]
    b = [q.enter("10.0.0.2") for _ in range(3)]
    a[0].started = a[1].started = True  # their checks run: never displaced
    assert q.total == 7 and q.held("10.0.0.1") == 4 and q.held("10.0.0.3") == 0
    assert not q.displace(more_than=4)  # nobody holds more than 4
    assert q.displace(more_than=1)
    assert a[3].scope.cancel_called and a[3].gone and q.held("10.0.0.1") == 3
    assert not any(e.scope.cancel_called for e in (*a[:3], *b))
    assert q.displace(more_than=1)  # 10.0.0.1 and .2 hold 3 each: the first found
    assert q.displace(more_than=1)
    # 10.0.0.1 holds its two running checks only; 10.0.0.2, as many, still waits in both
    assert q.held("10.0.0.1") == 2 and q.held("10.0.0.2") == 2
    assert q.displace(more_than=1)  # from 10.0.0.2: the first holder has nothing waiting
    assert q.held("10.0.0.2") == 1 and not q.displace(more_than=1)
    q.leave(a[3])  # already gone: counted once
    assert q.total == 3
    for e in (*a, *b):
        q.leave(e)
    assert q.total == 0 and q.held("10.0.0.1") == 0


def test_one_client_holds_at_most_its_share():
    anyio.run(_share)


async def _share() -> None:
    auth = basicauth.BasicAuth(
        lambda *a: None, {"u": basicauth.hash_password("p", rounds=4).encode()}
    )
    for _ in range(basicauth.MAX_PER_CLIENT):
        assert auth._admit("10.0.0.1")
        auth._queue.enter("10.0.0.1")
    assert not auth._admit("10.0.0.1")  # its share is full, the queue is not
    assert auth._admit("10.0.0.2")
