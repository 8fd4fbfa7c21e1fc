"""A publishing process as this host's kernel sees it: alive or not, and which process.

A file's envelope records its publisher's pid and `process_start` (field 22 of
`/proc/PID/stat`: start time in clock ticks since boot). A reader on the same host
tells a publisher that exited (no such pid, or a zombie) or whose pid now belongs to
another process (a different start time) from a live one.
"""

from __future__ import annotations

import os

_O_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_STAT_MAX = 4096  # /proc/PID/stat is one line of a few hundred bytes


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of `pid` from /proc, or None if absent."""
    # Read once per source per scan: os-level calls (open, read, close), not a buffered file
    # object (which adds an fstat, an ioctl and a second read).
    try:
        fd = os.open(f"/proc/{pid}/stat", _O_FLAGS)
    except OSError:
        return None
    try:
        stat = os.read(fd, _STAT_MAX)
    except OSError:
        return None
    finally:
        os.close(fd)
    # The command name (field 2) is in parentheses and may hold spaces; fields follow the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return fields[0].decode(), int(fields[19])
    except (IndexError, ValueError, UnicodeDecodeError):
        return None


def process_start_ticks(pid: int) -> int | None:
    """The start time of `pid` in clock ticks since boot (field 22 of /proc/PID/stat), or None."""
    st = proc_stat(pid)
    return st[1] if st else None
