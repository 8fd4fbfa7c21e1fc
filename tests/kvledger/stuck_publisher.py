"""A publisher that stops mid-write, for tests: killed there, it leaves its temporary file.

Run: python -m tests.kvledger.stuck_publisher DIR SOURCE
Publishes once, then blocks its next write after the data is written and before the
rename (in `fsync`), prints "stuck <temporary name>" and waits to be killed.
"""

from __future__ import annotations

import os
import sys
import threading

from accounting.ledger import Ledger
from accounting.snapfile.writer import Publisher


def main() -> None:
    directory, source = sys.argv[1], sys.argv[2]
    pub = Publisher(
        Ledger({"model_name": "stuck", "tp_rank": "0"}),
        directory,
        interval=3600,
        source=source,
        fsync=True,
    )
    before = set(os.listdir(directory))

    def stuck(fd: int) -> None:
        (tmp,) = set(os.listdir(directory)) - before
        print(f"stuck {tmp}", flush=True)
        threading.Event().wait()

    os.fsync = stuck  # type: ignore[assignment]  # the next write stops before its rename
    pub.publish()


if __name__ == "__main__":
    main()
