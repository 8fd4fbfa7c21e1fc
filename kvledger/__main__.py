"""`python -m kvledger ...` is the `kvledger` command."""

import sys

from exporter.server import early_signals

early_signals.install()  # first: a Ctrl-C from here on is recorded even if something drops it

try:
    from kvledger.cli import main
except KeyboardInterrupt:  # Ctrl-C while the command is still being imported
    sys.exit(130)

sys.exit(main())
