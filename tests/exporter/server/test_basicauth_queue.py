"""The basic-auth check queue's share per client (`exporter.server.basicauth._CheckQueue`):
which waiting request gives up its place when the queue is full; the clients whose last
check failed (`_Suspects`) rank below the others."""

from __future__ import annotations

import anyio
import pytest

from exporter.server import basicauth

pytestmark = pytest.mark.skipif(not basicauth.available(), reason="needs bcrypt (kvledger[tls])")


def test_the_newest_waiting_request_of_the_biggest_holder_gives_up_its_place():
    anyio.run(_biggest_holder_gives_up)  # cancel scopes belong to an event loop


def _displace(q: basicauth._CheckQueue, *, held: int, suspect: bool = False, suspects=()) -> bool:
    """A request of a newcomer holding `held` places (entered here, taken out after)."""
    newcomer = "192.0.2.1"
    entries = [q.enter(newcomer) for _ in range(held)]
    for e in entries:
        e.started = True  # (never a victim of its own request)
    try:
        return q.displace(
            newcomer, is_suspect=lambda c: c in suspects or (c == newcomer and suspect)
        )
    finally:
        for e in entries:
            q.leave(e)


async def _biggest_holder_gives_up() -> None:
    q = basicauth._CheckQueue()
    a = [q.enter("10.0.0.1") for _ in range(4)]
    b = [q.enter("10.0.0.2") for _ in range(3)]
    a[0].started = a[1].started = True  # their checks run: never displaced
    assert q.total == 7 and q.held("10.0.0.1") == 4 and q.held("10.0.0.3") == 0
    assert not _displace(q, held=3)  # nobody holds more than 4
    assert _displace(q, held=0)
    assert a[3].scope.cancel_called and a[3].gone and q.held("10.0.0.1") == 3
    assert not any(e.scope.cancel_called for e in (*a[:3], *b))
    assert _displace(q, held=0)  # 10.0.0.1 and .2 hold 3 each: the first found
    assert _displace(q, held=0)
    # 10.0.0.1 holds its two running checks only; 10.0.0.2, as many, still waits in both
    assert q.held("10.0.0.1") == 2 and q.held("10.0.0.2") == 2
    assert _displace(q, held=0)  # from 10.0.0.2: the first holder has nothing waiting
    assert q.held("10.0.0.2") == 1 and not _displace(q, held=0)
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


def test_a_suspect_gives_up_its_place_to_a_client_that_is_not_one():
    anyio.run(_suspect_gives_up)


async def _suspect_gives_up() -> None:
    q = basicauth._CheckQueue()
    flood = [q.enter(f"10.0.1.{i}") for i in range(10)]  # ten addresses, one place each
    flood[0].started = flood[1].started = True
    suspects = {f"10.0.1.{i}" for i in range(10)}
    # the same rank (one place each, a newcomer holding none): nobody gives way, as before
    assert not _displace(q, held=0)
    assert not _displace(q, held=0, suspect=True, suspects=suspects)
    # a client that is not a suspect takes the place of a suspect's waiting request
    assert _displace(q, held=0, suspects=suspects)
    cancelled = [e for e in flood if e.scope.cancel_called]
    assert len(cancelled) == 1 and not cancelled[0].started and q.total == 9
    # ...but never a running check, nor the place of a client that is not a suspect
    clean = q.enter("10.0.2.1")
    for _ in range(7):
        assert _displace(q, held=0, suspects=suspects)
    assert q.total == 3 and not clean.scope.cancel_called
    assert not _displace(q, held=0, suspects=suspects)  # only running checks and `clean` left
    for e in (*flood, clean):
        q.leave(e)
    assert q.total == 0


def test_a_client_is_a_suspect_from_a_failed_check_until_one_passes_or_time_passes(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(basicauth.time, "monotonic", lambda: now[0])
    s = basicauth._Suspects()
    assert not s.now("10.0.0.1")
    s.record("10.0.0.1", failed=True)
    assert s.now("10.0.0.1") and not s.now("10.0.0.2")
    s.record("10.0.0.1", failed=False)  # a check of its own passed
    assert not s.now("10.0.0.1")
    s.record("10.0.0.1", failed=True)
    now[0] += basicauth.SUSPECT_SECONDS + 1
    assert not s.now("10.0.0.1")  # forgotten with time
    monkeypatch.setattr(basicauth, "MAX_SUSPECTS", 3)
    for i in range(5):
        s.record(f"10.0.3.{i}", failed=True)
    assert [s.now(f"10.0.3.{i}") for i in range(5)] == [False, False, True, True, True]


def test_a_failed_check_makes_its_client_a_suspect_and_a_passed_one_clears_it():
    anyio.run(_checks_rank)


async def _checks_rank() -> None:
    users = {"u": basicauth.hash_password("p", rounds=4).encode()}
    auth = basicauth.BasicAuth(lambda *a: None, users)

    def header(user: str, password: str) -> bytes:
        import base64

        return b"Basic " + base64.b64encode(f"{user}:{password}".encode())

    assert await auth._check(header("u", "wrong"), "10.0.0.1") is False
    assert auth._suspects.now("10.0.0.1") and not auth._suspects.now("10.0.0.2")
    assert await auth._check(header("u", "p"), "10.0.0.1") is True
    assert not auth._suspects.now("10.0.0.1")
    assert await auth._check(header("nobody", "p"), "10.0.0.2") is False  # unknown user: fails
    assert auth._suspects.now("10.0.0.2")
