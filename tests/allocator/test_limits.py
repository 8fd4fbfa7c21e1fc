"""The pool at OS limits (issue 11): a lowered RLIMIT_FSIZE and the process's map count, each
reached in a child process (tests/allocator/limits_child.py). At the limit an allocation
fails cleanly (DriverError, nothing held leaked, books equal to the kernel's), frees still
return memory, the pool allocates again, close() completes, every failure is counted in the
ledger and logged once per interval."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from accounting.ledger import Ledger
from allocator.errors import DriverError
from allocator.host import HostBackend
from allocator.slots.layout import SlotLayout
from allocator.slots.pool import SwaPool
from tests.allocator.rigs import KIB, SMALL_GRANULARITY, FailingBackend, pool_account

ROOT = Path(__file__).parents[2]


def child(mode: str) -> dict[str, Any]:
    r = subprocess.run(
        [sys.executable, "-m", "tests.allocator.limits_child", mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr  # the child neither raised nor aborted
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def check(out: dict[str, Any], *, error: str, layers: int, slots_per_page: int) -> None:
    lim = out["at_limit"]
    assert error in lim["error"]
    assert lim["failed_calls"] == 50  # every attempt at the limit failed cleanly...
    assert lim["ledger_failures"] == lim["stats"]["driver_failures"] == 51  # ...and counted
    # one line, not 51, and it counts the one failure it reports (the line also carries the
    # failed address, whose hex digits may hold any number)
    assert len(out["log_lines"]) == 1
    assert " 1 driver/OS failure(s) since the last report (1 in all)" in out["log_lines"][0]
    # Nothing leaked: the books equal the kernel's at the limit.
    st = lim["stats"]
    assert lim["backend_handles"] == st["live_handle_sets"] * layers
    assert lim["backend_physical"] == lim["ledger_physical"] == st["physical_bytes"]
    assert st["mapped_pages"] == st["live_handle_sets"]
    assert st["occupied_slots"] == lim["held_slots"]  # the null slot is not counted
    assert lim["violations"] == 0
    # Frees returned the memory: only the null slot's page stays.
    after = out["after_free"]
    assert after["stats"]["occupied_slots"] == 0 and after["stats"]["mapped_pages"] == 1
    assert after["backend_physical"] == after["ledger_physical"] == after["stats"]["physical_bytes"]
    assert out["again"] == slots_per_page
    assert out["after_close"] == {"handles": 0, "closed": True}


def test_file_size_limit_fails_cleanly_and_frees_work() -> None:
    out = child("fsize")
    check(out, error="EFBIG", layers=2, slots_per_page=4)
    assert out["at_limit"]["stats"]["mapped_pages"] == 3  # what 6 granules of file hold


def test_map_count_limit_fails_cleanly_and_frees_work() -> None:
    out = child("maps")
    check(out, error="ENOMEM", layers=1, slots_per_page=1)
    assert "vm.max_map_count" in out["at_limit"]["error"]
    assert out["at_limit"]["held_slots"] > 10_000  # it really got near the limit


def test_close_completes_when_every_driver_call_fails(caplog: pytest.LogCaptureFixture) -> None:
    """close() never raises and never stops half way: unmap, release and freeing the
    reservation all failing are counted and logged; the backend's close frees the rest."""
    layout = SlotLayout(capacity_slots=64, slot_bytes=16 * KIB, page_bytes=SMALL_GRANULARITY)
    host = HostBackend(SMALL_GRANULARITY)
    fb = FailingBackend(host)
    ledger = Ledger()
    account = pool_account(ledger, 2, layout)
    pool = SwaPool(fb, layers=2, layout=layout, observer=account)
    pool.alloc(10)

    class Always(FailingBackend):
        def _count(self, op: str, address: int | None = None) -> None:
            if op in ("unmap", "release", "free_reservation"):
                raise DriverError(op, "INJECTED_FAILURE", "always", address)

    pool.store.pages.backend = Always(host)
    pool.close()
    pool.close()
    assert pool.closed and pool.stats()["driver_failures"] >= 3
    assert account.driver_failures_total == pool.stats()["driver_failures"]
    assert "INJECTED_FAILURE" in caplog.text
    ledger.remove_account(account)  # detached: the account can go
    host.close()
    assert host.closed


def test_failure_log_writes_one_line_per_interval_with_the_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from allocator.faillog import FailureLog

    log = FailureLog("swa", interval_s=0.2)
    err = DriverError("map", "ENOMEM", "at the limit")
    for _ in range(100):
        log.record("map", err)
    assert len(caplog.records) == 1 and "1 driver/OS failure(s)" in caplog.text
    time.sleep(0.25)
    log.record("unmap", err)
    log.record("unmap", err)
    assert len(caplog.records) == 2
    assert "100 driver/OS failure(s) since the last report (101 in all)" in caplog.text
    assert log.total == 102 and log.by_op == {"map": 100, "unmap": 2}
