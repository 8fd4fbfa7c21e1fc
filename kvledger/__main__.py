"""`python -m kvledger ...` is the `kvledger` command."""

import sys

try:
    from kvledger.cli import main
except KeyboardInterrupt:  # Ctrl-C while the command is still being imported
    sys.exit(130)

sys.exit(main())
