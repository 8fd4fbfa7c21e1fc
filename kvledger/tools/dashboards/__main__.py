"""`python -m kvledger.tools.dashboards --out DIR | --check DIR`: the same as `kvledger dashboards`."""

from __future__ import annotations

import sys

from kvledger.tools.dashboards.command import main

if __name__ == "__main__":
    sys.exit(main())
