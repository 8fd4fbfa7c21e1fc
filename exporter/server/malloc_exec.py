"""`kvledger serve --malloc jemalloc`: the server's memory allocator, chosen by starting the
process again with jemalloc preloaded (the one place kvledger sets `LD_PRELOAD`).

Why. After 1,000 snapshot sources come and go, Python's own allocator keeps about 24 MiB
(40 %) over the server's start: it gives memory back only as whole 1 MiB arenas, and the
objects that churn after the peak (a scan, a request) keep landing in the peak's arenas
(docs/benchmarks.md, "Scale"). glibc's malloc in its place keeps as much. jemalloc returns
free pages one by one, after `dirty_decay_ms`: the same run ends at 1.14-1.17x its start
(`kvledger bench scrape --parts scale --scale-malloc jemalloc`), with the same scrape
latency.

How. An allocator is chosen before the interpreter starts, so `reexec()` replaces the
process (`os.execve`, the same pid, argv and environment) by the same command with
`LD_PRELOAD` naming the library, `PYTHONMALLOC=malloc` (every object through it, not only
the large ones) and `MALLOC_CONF` (pages given back after 1 s by a thread of jemalloc's,
unless the caller set its own), plus `KVLEDGER_MALLOC=jemalloc`, which marks the second start: it does not start
again, and checks that the library is mapped (`loaded()`).

Trust. kvledger serve often runs as root, and a preloaded library runs as the process.
The library is looked for only at fixed system paths (`JEMALLOC_PATHS`, Debian's and
Red Hat's), never from the environment, the working directory or an argument; the file
found, after its links are resolved, and every directory above it must be owned by root
(or by the user running kvledger) and writable by no one else (`refusal()`).
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Mapping, Sequence

MARK = "KVLEDGER_MALLOC"  # set by reexec() in the second start's environment
# Pages given back 1 s after they are freed, by jemalloc's own thread: without it, decay runs
# only when the arena that freed them allocates again, and an arena that a flood of
# connections used and left stays as the flood left it (107 of 64 MiB after 1,100 silent
# TLS connections, against 77 with the thread: scripts/attack-probe).
DEFAULT_CONF = "background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0"
JEMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",  # Debian, Ubuntu
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",  # Red Hat, Fedora, SUSE
    "/usr/lib/libjemalloc.so.2",
)
CHOICES = ("python", "jemalloc")


def refusal(path: str, owners: Sequence[int] | None = None, top: str = "/") -> str | None:
    """Why the library at `path` may not be preloaded, or None when it may: it (links
    resolved) must be a regular file, and it and every directory above it, up to `top`,
    owned by one of `owners` (root and the running user) and not writable by group or
    others (a sticky bit does not excuse it)."""
    allowed = set(owners) if owners is not None else {0, os.geteuid()}
    try:
        real = os.path.realpath(path, strict=True)
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    try:
        st = os.stat(real)
    except OSError as e:  # pragma: no cover - gone between the two calls
        return f"{real}: {e.strerror or e}"
    if not stat.S_ISREG(st.st_mode):
        return f"{real}: not a regular file"
    where = real
    while True:
        try:
            st = os.stat(where)
        except OSError as e:
            return f"{where}: {e.strerror or e}"
        if st.st_uid not in allowed:
            return f"{where}: owned by uid {st.st_uid}, expected root or uid {os.geteuid()}"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{where}: writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
        parent = os.path.dirname(where)
        if parent == where or where == top:
            return None
        where = parent


def find_jemalloc(
    paths: Sequence[str] = JEMALLOC_PATHS, owners: Sequence[int] | None = None, top: str = "/"
) -> tuple[str | None, list[str]]:
    """The first trusted library of `paths`, and why each one before it was passed over."""
    why: list[str] = []
    for p in paths:
        reason = refusal(p, owners, top)
        if reason is None:
            return p, why
        why.append(reason)
    return None, why


def second_start(env: Mapping[str, str] = os.environ) -> bool:
    """True in the process `reexec()` started."""
    return env.get(MARK) == "jemalloc"


def launched_as_command() -> bool:
    """True when this process is `kvledger ...` or `python -m kvledger ...`, so that starting
    it again runs the same command (not a test or a program embedding kvledger)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name in ("kvledger", "kvledger.__main__"):
        return True
    return os.path.basename(sys.argv[0]) == "kvledger"


def environment(library: str, env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`env` for the second start: the library preloaded first (an existing LD_PRELOAD
    kept after it), every object through it, its pages given back after 1 s."""
    out = dict(env)
    out["LD_PRELOAD"] = library + (f":{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else "")
    out["PYTHONMALLOC"] = "malloc"
    out.setdefault("MALLOC_CONF", DEFAULT_CONF)
    out[MARK] = "jemalloc"
    return out


def reexec(library: str) -> None:  # pragma: no cover - replaces the process (tested by running it)
    """Start this command again under `library`; does not return."""
    sys.stdout.flush()
    sys.stderr.flush()
    argv = [sys.executable, *sys.orig_argv[1:]]
    os.execve(sys.executable, argv, environment(library))


def loaded(library: str, maps: str = "/proc/self/maps") -> bool | None:
    """Whether `library` is mapped into this process (None where `maps` cannot be read)."""
    real = os.path.realpath(library)
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            return any(line.rstrip().endswith((f" {library}", f" {real}")) for line in f)
    except OSError:
        return None
