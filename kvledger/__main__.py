"""`python -m kvledger ...`, the same as the `kvledger` script."""

import sys

from kvledger.cli import main

sys.exit(main())
