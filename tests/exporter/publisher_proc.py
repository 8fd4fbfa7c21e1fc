"""A stand-in engine process for tests: one rank's ledger, its figures moving, published to a dir.

Run: python -m tests.exporter.publisher_proc DIR RANK INTERVAL
Prints "published <source>" once its first snapshot is on disk, then runs until killed.
"""

from __future__ import annotations

import signal
import sys
import threading

import torch

from accounting.buffers import runtime_buffer
from accounting.ledger import Ledger
from accounting.snapfile.writer import Publisher


def main() -> None:
    directory, rank, interval = sys.argv[1], sys.argv[2], float(sys.argv[3])
    ledger = Ledger({"model_name": "mp-test", "tp_rank": rank})
    tensor = torch.empty(1000, 64, dtype=torch.uint8)
    account = ledger.add_account(
        [runtime_buffer(tensor, name="c4_kv.0", family="c4_kv", pool="c4", layer=0)]
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with Publisher(ledger, directory, interval=interval) as pub:
        pub.publish()
        print(f"published {pub.source}", flush=True)
        n = 0
        while not stop.wait(0.02):
            n += 1
            if n % 50 == 0:
                account.release(account.occupied_slots)
            account.occupy(1)


if __name__ == "__main__":
    main()
