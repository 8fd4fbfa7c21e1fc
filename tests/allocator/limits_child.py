"""A pool driven into an OS limit in a child process; prints what happened as JSON.

    python -m tests.allocator.limits_child fsize|maps

`fsize`: RLIMIT_FSIZE lowered to a few pages: the host backend's memfd cannot grow, so
`create` fails (EFBIG). `maps`: every other page of a 4 KiB-granularity pool is mapped
until the process's map count (vm.max_map_count) is reached, so `mmap` fails (ENOMEM).
Run by tests/allocator/test_limits.py in a subprocess: the limits must not touch the
test runner.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
from typing import Any

from accounting.ledger import Ledger
from allocator.errors import CapacityError, DriverError
from allocator.host import HostBackend
from allocator.slots.layout import SlotLayout
from allocator.slots.pool import SwaPool
from tests.allocator.rigs import pool_account

KIB = 1024


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def map_count() -> int:
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


def run(mode: str) -> dict[str, Any]:
    lines = Lines()
    logging.getLogger("allocator").addHandler(lines)
    if mode == "fsize":
        gran, layers, per_page = 64 * KIB, 2, 4
        layout = SlotLayout(capacity_slots=64, slot_bytes=16 * KIB, page_bytes=gran)
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (6 * gran, hard))  # 3 page ids of 2 layers
    else:
        gran, layers, per_page = 4 * KIB, 1, 1
        limit = HostBackend(gran).map_limit  # vm.max_map_count
        slots = limit  # every other slot occupied: 2 VMAs each, more than the limit allows
        layout = SlotLayout(capacity_slots=slots, slot_bytes=gran, page_bytes=gran)
    be = HostBackend(gran)
    ledger = Ledger()
    account = pool_account(ledger, layers, layout)
    pool = SwaPool(
        be,
        layers=layers,
        layout=layout,
        max_spare_pages=0,
        handle_pool_pages=0,
        observer=account,
    )
    # One log line for the whole run, however slow the machine (rate limiting has its own test).
    pool.store.reporter.failures.interval_s = 3600.0
    held: list[list[int]] = []
    error = ""
    failed_calls = 0
    try:
        if mode == "fsize":
            while True:
                held.append(pool.alloc(per_page).tolist())
        else:
            batch = 512
            for start in range(2, layout.capacity_slots, 2 * batch):
                ids = list(range(start, min(start + 2 * batch, layout.capacity_slots), 2))
                pool.occupy(ids)
                held.append(ids)
    except (DriverError, CapacityError) as e:
        error = f"{type(e).__name__}: {e}"
    # More attempts at the limit: each fails cleanly, each is counted, one log line for all.
    nxt = held[-1][-1] + 2 if held and mode == "maps" else 0
    for _ in range(50):
        try:
            if mode == "fsize":
                held.append(pool.alloc(per_page).tolist())
            else:
                ids = list(range(nxt, min(nxt + 2 * 512, layout.capacity_slots), 2))
                pool.occupy(ids)  # the next batch of 512 pages: 1024 maps more
                held.append(ids)
                nxt += 2 * 512
        except (DriverError, CapacityError):
            failed_calls += 1
    stats = pool.stats()
    snap = ledger.snapshot()
    at_limit = {
        "error": error,
        "failed_calls": failed_calls,
        "held_slots": sum(len(h) for h in held),
        "stats": stats,
        "backend_handles": be.stats()["handles"],
        "backend_physical": be.physical_bytes(),
        "ledger_physical": snap.total("physical_bytes"),
        "ledger_failures": account.driver_failures_total,
        "violations": len(snap.violations),
        "map_count": map_count(),
    }
    for ids in held:  # frees still work and return memory
        pool.free(ids)
    after_free = {
        "stats": pool.stats(),
        "backend_physical": be.physical_bytes(),
        "ledger_physical": ledger.snapshot().total("physical_bytes"),
    }
    again = pool.alloc(per_page).tolist()  # and the pool still allocates
    pool.free(again)
    pool.close()
    pool.close()
    be.close()
    return {
        "at_limit": at_limit,
        "after_free": after_free,
        "again": len(again),
        "after_close": {"handles": be.stats()["handles"], "closed": pool.closed},
        "log_lines": lines.lines,
        "pid": os.getpid(),
    }


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1])))
