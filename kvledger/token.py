"""The bearer token of `kvledger serve`: from a file or the environment, never from argv.

A command line is readable by every local user (`ps`, `/proc/PID/cmdline`), so a
token given there is no secret. `load_token(path, env)` reads `--token-file` (a
regular file of this user or root, not writable by its group nor readable or
writable by others, at most 4 KiB; links are followed, as a mounted secret is
often one) or else `$KVLEDGER_TOKEN`; surrounding whitespace is stripped, and the
token must be printable ASCII without spaces (it travels in an HTTP header).
Every refusal is a `TokenError` with one line naming the file and the rule.
"""

from __future__ import annotations

import os
import stat

from accounting.snapfile.directory import trusted_owners

ENV = "KVLEDGER_TOKEN"
MAX_BYTES = 4096
ARGV_REFUSED = (
    "--token on the command line is readable by every local user (ps, /proc/PID/cmdline); "
    f"put the token in a file only you can read and pass --token-file FILE, or set {ENV}"
)


class TokenError(ValueError):
    pass


def load_token(path: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The token from `path`, else from `$KVLEDGER_TOKEN`, else None (no token)."""
    env = os.environ if environ is None else environ
    if path is None:
        value = env.get(ENV)
        return _check(value, f"${ENV}") if value else None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise TokenError(f"--token-file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TokenError(f"--token-file {path}: not a regular file")
        if st.st_uid not in trusted_owners():
            raise TokenError(
                f"--token-file {path}: owned by uid {st.st_uid}, expected uid {os.geteuid()} "
                "(this user) or root"
            )
        if st.st_mode & 0o027:
            raise TokenError(
                f"--token-file {path}: mode {stat.S_IMODE(st.st_mode):04o} lets others read "
                f"or its group write it; expected 0600 or 0640: chmod 600 {path}"
            )
        if st.st_size > MAX_BYTES:
            raise TokenError(f"--token-file {path}: {st.st_size} bytes, expected a token")
        data = os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise TokenError(f"--token-file {path}: expected printable ASCII") from None
    return _check(text, f"--token-file {path}")


def _check(text: str, where: str) -> str:
    token = text.strip()
    if not token:
        raise TokenError(f"{where}: empty, expected a token")
    if len(token) > MAX_BYTES or not all(33 <= ord(c) < 127 for c in token):
        raise TokenError(f"{where}: expected printable ASCII without spaces")
    return token
