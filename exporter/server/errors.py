"""The one error the server's set-up raises for bad input (a flag, a file, an address):
its text is one line naming the value and what was expected, printed as is, exit status 2.
`kvledger.cli.UsageError` is this class."""


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""
