"""The bearer token of `kvledger serve`: from a file or the environment, never from argv.

A command line is readable by every local user (`ps`, `/proc/PID/cmdline`), so a
token given there is no secret. `load_token(path, env)` reads `--token-file` (a
regular file of this user or root, not writable by its group nor readable or
writable by others, at most 4 KiB; links are followed, as a mounted secret is
often one) or else `$KVLEDGER_TOKEN`; surrounding whitespace is stripped, and the
token must be printable ASCII without spaces (it travels in an HTTP header).
Every refusal is a `TokenError` with one line naming the file and the rule. The file is
read by `exporter.server.private_file`, as the web config's files are.
"""

from __future__ import annotations

import os

from exporter.server import private_file

ENV = "KVLEDGER_TOKEN"
MAX_BYTES = 4096
ARGV_REFUSED = (
    "--token on the command line is readable by every local user (ps, /proc/PID/cmdline); "
    f"put the token in a file only you can read and pass --token-file FILE, or set {ENV}"
)


# group-readable is allowed (a Secret's 0640 for a group of readers), nothing else
MODE = private_file.ModeRule(0o027, "lets others read or its group write it", "0600 or 0640", "600")


class TokenError(ValueError):
    pass


def load_token(path: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The token from `path`, else from `$KVLEDGER_TOKEN`, else None (no token)."""
    env = os.environ if environ is None else environ
    if path is None:
        value = env.get(ENV)
        return _check(value, f"${ENV}") if value else None
    where = f"--token-file {path}"
    with private_file.opened(
        path, where, limit=MAX_BYTES, modes=(MODE,), error=TokenError, too_big="a token"
    ) as (data, _):
        try:
            text = data.decode("ascii")
        except UnicodeDecodeError:
            raise TokenError(f"{where}: expected printable ASCII") from None
    return _check(text, where)


def _check(text: str, where: str) -> str:
    token = text.strip()
    if not token:
        raise TokenError(f"{where}: empty, expected a token")
    if len(token) > MAX_BYTES or not all(33 <= ord(c) < 127 for c in token):
        raise TokenError(f"{where}: expected printable ASCII without spaces")
    return token
