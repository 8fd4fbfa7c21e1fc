"""A checked read of a file that holds a secret or decides who may connect.

`opened(path, where, limit=..., modes=..., error=...)` opens `path` (links are followed, as
a mounted secret is often one), then, on the descriptor it opened, requires a regular file
owned by this user or root, none of the mode bits of each `ModeRule`, and at most `limit`
bytes, and reads it with that bound. It yields (the bytes, the open descriptor), so that a
caller loading the file by name again (`/proc/self/fd/N`) loads the file it checked; the
descriptor is closed on exit. Every refusal is `error` (the caller's exception class) with
one line starting with `where` and naming the rule. `exporter.server.token` (the bearer token) and
`exporter.server.webconfig` (the web config, certificates, private key) read their files so, each
with its own mode rules.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from accounting.snapfile.directory import trusted_owners


@dataclass(frozen=True)
class ModeRule:
    """Mode bits a file must not have, and the words of the refusal:
    `{where}: mode 0644 {lets}; expected {expected}: chmod {chmod} {path}`."""

    mask: int
    lets: str  # what the bits allow, e.g. "lets its group or others write it"
    expected: str  # e.g. "0600 or 0640"
    chmod: str  # the chmod argument that fixes it, e.g. "600" or "go-w"

    def __post_init__(self) -> None:
        if isinstance(self.mask, bool) or not isinstance(self.mask, int):
            raise TypeError(f"ModeRule mask={self.mask!r}, expected an int of mode bits")
        if not 0 < self.mask <= 0o7777:
            raise ValueError(f"ModeRule mask={self.mask:#o}, expected mode bits in 0o1..0o7777")


@contextmanager
def opened(
    path: str,
    where: str,
    *,
    limit: int,
    modes: Sequence[ModeRule],
    error: type[Exception],
    too_big: str | None = None,
) -> Iterator[tuple[bytes, int]]:
    """(the file's bytes, its open descriptor) once it passed the rules; closed on exit.
    `too_big`: what the size refusal says is expected (default "at most {limit}")."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise ValueError(f"{where}: read limit={limit!r}, expected a positive int of bytes")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise error(f"{where}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{where}: not a regular file")
        if st.st_uid not in trusted_owners():
            raise error(
                f"{where}: owned by uid {st.st_uid}, expected uid {os.geteuid()} (this user) or root"
            )
        mode = stat.S_IMODE(st.st_mode)
        for rule in modes:
            if mode & rule.mask:
                raise error(
                    f"{where}: mode {mode:04o} {rule.lets}; expected {rule.expected}: "
                    f"chmod {rule.chmod} {path}"
                )
        expected = too_big if too_big is not None else f"at most {limit}"
        if st.st_size > limit:
            raise error(f"{where}: {st.st_size} bytes, expected {expected}")
        data = os.pread(fd, limit + 1, 0)
        if len(data) > limit:  # it grew since the fstat
            raise error(f"{where}: more than {limit} bytes, expected {expected}")
        yield data, fd
    finally:
        os.close(fd)
