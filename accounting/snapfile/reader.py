"""The reader: a scan of the snapshot directory, which files are read, how, and what a
refused one costs.

`SnapshotFiles.scan()` lists the directory through its descriptor
(`accounting.snapfile.directory.SnapshotDir`) and returns a `FileScan`: the files
served and what went wrong, together. A file is read only if it is named
`<source>.json` (no leading dot), is a regular file (lstat before opening, fstat
after), is owned by this process's user or root (in group mode: any member of the
directory's group), is at most `max_bytes` long, and its first line passes
`accounting.snapfile.head.load` (the buffer rows are kept as bytes for
`accounting.snapfile.head.buffer_map`, run when someone asks for the buffer map). It is
opened with O_NOFOLLOW and O_NONBLOCK, so a link planted in its place fails and a
FIFO cannot hang the read; devices are refused by the lstat before any open.

Every refusal is kept per file (`problems`: name -> reason and a one-line detail,
shown in /debug/kv) and counted per reason (`error_counts`, a small fixed set of
reasons: `accounting.snapfile.format.REASONS`; `count` adds a served file whose
buffer rows failed later). Each scan hands back a copy of both with the files it
serves. A file is identified by (st_dev, st_ino, st_size, st_mtime_ns);
one that was parsed, or refused, is not read again until that identity changes.
A scan looks at most `max_files` names and parses at most `max_parses` changed
files (the others wait for the next scan), so its cost is bounded whatever the
directory holds; past `max_files`, files already served are kept first, so a
flood of new files cannot push a live source out.

Each scan also asks whether a publisher could write a file there now (`write_problem`:
one `fstatvfs` and one `faccessat` of the open directory, no file written): a read-only
mount (`read_only`), a directory this user may not write (`permission`), no inode left
(`no_inodes`) or less room than the largest file served (`no_space`). While one holds it is
the scan's `write_problem` (shown first among the problems, named by its reason), so a
silent publisher's cause is seen here, and it is gone from the next scan once it no
longer holds.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from accounting.snapfile.directory import (
    TEMP_GRACE_S,
    SnapshotDir,
    SnapshotDirError,
    out_of_inodes,
    trusted_owners,
)
from accounting.snapfile.format import REASONS, SUFFIX, Refused
from accounting.snapfile.head import Head, load

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 8 << 20  # a DeepSeek-V4 rank's file is ~0.2 MiB
MAX_FILES = 1024  # snapshot files looked at per scan; more are one "too_many_files" problem
MAX_PARSES = 64  # changed files parsed per scan
MAX_PROBLEMS_SHOWN = 100  # problems listed in /debug/kv (all are counted)
NO_SPACE_MIN_BYTES = 4096  # less free than this (or than a file served) is no space
_ST_RDONLY = getattr(os, "ST_RDONLY", 1)
_ACCESS_EFFECTIVE = os.access in os.supports_effective_ids

Ident = tuple[int, int, int, int]
T = TypeVar("T")


@dataclass(frozen=True)
class FileProblem:
    name: str
    reason: str  # one of REASONS; the directory's (name ""): "directory" or a DIRECTORY_REASONS
    detail: str


@dataclass(frozen=True)
class ServedFile(Generic[T]):
    name: str
    ident: Ident  # (st_dev, st_ino, st_size, st_mtime_ns) of the version read
    value: T  # what `make` made of it


@dataclass(frozen=True)
class FileScan(Generic[T]):
    """One scan of the directory: the files served, in name order, and what went wrong,
    as of that scan."""

    served: tuple[ServedFile[T], ...] = ()
    problems: tuple[FileProblem, ...] = ()  # as /debug/kv lists them (bounded)
    unreadable: int = 0  # files in the directory not served now
    error_counts: Mapping[str, int] = field(default_factory=dict)  # refusals so far, by reason
    parses: int = 0  # files parsed so far
    directory_problem: str | None = None  # why the directory is not usable now, if it is not
    # why no publisher can write a file there now, if none can (reason: one of
    # accounting.snapfile.format.DIRECTORY_REASONS)
    write_problem: FileProblem | None = None


_KIND = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


class SnapshotFiles(Generic[T]):
    """The served files of one snapshot directory. `make(head, path)` turns a file that
    passed every check into what is cached and returned (once per identity).

    The directory is opened on the first scan that finds it (or at once with `create`);
    an existing directory that breaks the rules raises SnapshotDirError here, and later
    (the path replaced by another directory) becomes `directory_problem`, with no files
    served until it is right again.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        make: Callable[[Head, str], T],
        *,
        create: bool = False,
        group_writable: bool = False,
        max_files: int = MAX_FILES,
        max_parses: int = MAX_PARSES,
        max_bytes: int = MAX_FILE_BYTES,
        temp_grace: float = TEMP_GRACE_S,
    ) -> None:
        if not isinstance(temp_grace, (int, float)) or not 0 < temp_grace < float("inf"):
            raise ValueError(f"SnapshotFiles: temp_grace={temp_grace!r}, expected seconds > 0")
        self.path = os.path.abspath(os.fspath(path))
        self.temp_grace = float(temp_grace)
        self.temporaries_removed = 0  # dead writers' temporary files removed so far
        self.forgotten = 0  # cached files forgotten (gone from the directory) so far
        self._next_sweep = 0.0
        self._make = make
        self._create = create
        self.group_writable = group_writable
        self.max_files = max_files
        self.max_parses = max_parses
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._dir: SnapshotDir | None = None
        self._cache: dict[str, tuple[Ident, T | None]] = {}
        self._loaded: dict[str, float] = {}  # when each cached version was parsed (monotonic)
        self.problems: dict[str, FileProblem] = {}
        self.error_counts: dict[str, int] = dict.fromkeys(REASONS, 0)
        self.directory_problem: str | None = None
        self.write_problem: FileProblem | None = None
        self.skipped = 0  # snapshot files past max_files at the last scan
        self.parses = 0  # files parsed so far
        self._open_dir(raise_errors=True)

    def _open_dir(self, *, raise_errors: bool) -> bool:
        try:
            self._dir = SnapshotDir(
                self.path, create=self._create, group_writable=self.group_writable
            )
        except FileNotFoundError:
            self.directory_problem = f"snapshot directory {self.path} does not exist (yet)"
            return False
        except (SnapshotDirError, OSError) as e:
            if raise_errors and isinstance(e, SnapshotDirError):
                raise
            why = str(e) if isinstance(e, SnapshotDirError) else f"{self.path}: {e.strerror}"
            if why != self.directory_problem:
                log.warning("%s; serving no file sources until it is fixed", why)
            self.directory_problem = why
            return False
        self.directory_problem = None
        return True

    # -- scanning ----------------------------------------------------------------------------
    def scan(self, now: float, keep_young: float = 0.0) -> FileScan[T]:
        """The files served now and what went wrong, as of this scan. `keep_young` (s): a
        changed file whose served version was parsed less than that long ago keeps serving
        it, unparsed (a background scan parses the newer one; `exporter.sources`)."""
        with self._lock:
            if self._dir is not None and self._dir.moved():
                self._dir.close()
                self._dir = None
            if self._dir is None and not self._open_dir(raise_errors=False):
                self._cache.clear()
                self._loaded.clear()
                self.problems.clear()
                served: list[ServedFile[T]] = []
                self.write_problem = None
            else:
                assert self._dir is not None
                served = self._scan(self._dir, now, keep_young)
                self._sweep(self._dir, now)
                need = max((f.ident[2] for f in served), default=0)
                self._set_write_problem(self._writable(self._dir, need))
            return FileScan(
                served=tuple(served),
                problems=tuple(self._shown_problems()),
                unreadable=len(self.problems),
                error_counts=dict(self.error_counts),
                parses=self.parses,
                directory_problem=self.directory_problem,
                write_problem=self.write_problem,
            )

    @property
    def permission_checked(self) -> bool:
        """Whether this user's access to the directory tells its publishers': the directory
        is this user's and not shared with a group (root's directory read by another user
        is written by root's publishers, a group's by its members)."""
        d = self._dir
        if d is None or self.group_writable:
            return False
        try:
            return os.fstat(d.fd).st_uid == os.geteuid()
        except OSError:
            return False

    def _writable(self, d: SnapshotDir, need: int) -> FileProblem | None:
        """Why a publisher could not write a file of `need` bytes in `d` now, or None: a
        read-only mount, no write and search permission for this user where that tells
        (`permission_checked`; an immutable directory too, even for root), no inode left,
        or fewer free bytes than max(`need`, NO_SPACE_MIN_BYTES). One fstatvfs, one fstat
        and one faccessat; nothing written."""
        try:
            fs = os.fstatvfs(d.fd)
        except OSError:
            return None
        if fs.f_flag & _ST_RDONLY:
            return FileProblem(
                "",
                "read_only",
                f"snapshot directory {self.path}: its filesystem is mounted read-only; no "
                "publisher can write a file there",
            )
        writable = True
        if self.permission_checked:
            try:
                kwargs = {"effective_ids": True} if _ACCESS_EFFECTIVE else {}
                writable = os.access(".", os.W_OK | os.X_OK, dir_fd=d.fd, **kwargs)
            except (OSError, NotImplementedError):
                pass
        if not writable:
            mode = stat.S_IMODE(os.fstat(d.fd).st_mode)
            return FileProblem(
                "",
                "permission",
                f"snapshot directory {self.path} (mode {mode:04o}) does not let uid "
                f"{os.geteuid()} create files; its publishers of this user cannot write",
            )
        free = fs.f_bavail * fs.f_frsize
        if out_of_inodes(fs):
            return FileProblem(
                "",
                "no_inodes",
                f"snapshot directory {self.path}: its filesystem has no inode left (0 of "
                f"{fs.f_files}) with {free} bytes free; no publisher can create a file",
            )
        if free < max(need, NO_SPACE_MIN_BYTES):
            return FileProblem(
                "",
                "no_space",
                f"snapshot directory {self.path}: its filesystem has {free} bytes free, less "
                f"than a file needs ({max(need, NO_SPACE_MIN_BYTES)} bytes)",
            )
        return None

    def _set_write_problem(self, problem: FileProblem | None) -> None:
        old = self.write_problem
        if problem is not None and (old is None or old.reason != problem.reason):
            log.warning("%s; publishers cannot write until it is fixed", problem.detail)
        elif problem is None and old is not None:
            log.info("snapshot directory %s: writable again (was %s)", self.path, old.reason)
        self.write_problem = problem

    def _scan(self, d: SnapshotDir, now: float, keep_young: float = 0.0) -> list[ServedFile[T]]:
        names = [
            e.name for e in d.names() if not e.name.startswith(".") and e.name.endswith(SUFFIX)
        ]  # dot files are temporaries of a write in progress; other names are not ours
        # Files already served first (for the cap on files and on parses), so a flood of
        # new files can neither push a live source out nor delay its next version.
        names.sort(key=lambda n: (not self._served(n), n))
        skipped = max(0, len(names) - self.max_files)
        names = names[: self.max_files]
        out: list[ServedFile[T]] = []
        parses = 0
        for name in names:
            try:
                st = d.lstat(name)
            except FileNotFoundError:
                continue  # removed since the listing (a publisher closing)
            ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            cached = self._cache.get(name)
            if cached is None or cached[0] != ident:
                young = keep_young > 0 and time.monotonic() - self._loaded.get(name, 0) < keep_young
                if young or parses >= self.max_parses:
                    if cached is not None and cached[1] is not None:
                        out.append(ServedFile(name, cached[0], cached[1]))  # the older version
                    continue
                parses += 1
                cached = (ident, self._load(d, name, st, now))
                self._cache[name] = cached
                self._loaded[name] = time.monotonic()
            if cached[1] is not None:
                out.append(ServedFile(name, ident, cached[1]))
        seen = set(names)
        gone = set(self._cache) - seen
        for name in gone:
            del self._cache[name]
            self._loaded.pop(name, None)
        for name in set(self.problems) - seen:
            del self.problems[name]
        self.forgotten += len(gone)
        if skipped and not self.skipped:
            log.warning(
                "snapshot directory %s: %d files past the first %d not read",
                self.path,
                skipped,
                self.max_files,
            )
            self.error_counts["too_many_files"] += 1
        self.skipped = skipped
        out.sort(key=lambda x: x.name)
        return out

    def _sweep(self, d: SnapshotDir, now: float) -> None:
        """Every few seconds, remove temporary files whose writer is gone (older than
        `temp_grace`; `SnapshotDir.remove_stale_temporaries` says which are touched)."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + max(1.0, min(10.0, self.temp_grace / 4))
        try:
            n = d.remove_stale_temporaries(now, self.temp_grace)
        except OSError as e:
            log.warning("snapshot directory %s: removing stale temporary files: %s", self.path, e)
            return
        if n:
            self.temporaries_removed += n
            log.info(
                "snapshot directory %s: removed %d temporary files of writers gone for over %g s",
                self.path,
                n,
                self.temp_grace,
            )

    def _served(self, name: str) -> bool:
        cached = self._cache.get(name)
        return cached is not None and cached[1] is not None

    def _load(self, d: SnapshotDir, name: str, st: os.stat_result, now: float) -> T | None:
        try:
            data = self._read(d, name, st)
            self.parses += 1
            head = load(data, name, now)
        except Refused as e:
            self._refuse(name, e)
            return None
        self.problems.pop(name, None)
        return self._make(head, os.path.join(self.path, name))

    def _check(self, name: str, st: os.stat_result) -> None:
        if stat.S_ISLNK(st.st_mode):
            raise Refused("symlink", "a symbolic link; only regular files are read")
        if not stat.S_ISREG(st.st_mode):
            kind = _KIND.get(stat.S_IFMT(st.st_mode), "not a regular file")
            raise Refused("not_regular", f"{kind}; only regular files are read")
        if st.st_uid not in trusted_owners() and not (
            self.group_writable and self._dir is not None and st.st_gid == self._dir_gid()
        ):
            raise Refused(
                "owner",
                f"owned by uid {st.st_uid}; expected uid {os.geteuid()} (this user) or root"
                + (" or the directory's group" if self.group_writable else ""),
            )
        if st.st_size > self.max_bytes:
            raise Refused("too_large", f"{st.st_size} bytes, over the cap of {self.max_bytes}")

    def _dir_gid(self) -> int:
        assert self._dir is not None
        return os.fstat(self._dir.fd).st_gid

    def _read(self, d: SnapshotDir, name: str, lst: os.stat_result) -> bytes:
        self._check(name, lst)  # before any open: a device is never opened
        try:
            fd = d.open_regular(name)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise Refused("symlink", "a symbolic link; only regular files are read") from None
            raise Refused("open", f"cannot open: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            self._check(name, st)  # what was opened, in case the name was swapped meanwhile
            chunks, left = [], self.max_bytes + 1
            while left > 0:
                want = min(left, max(st.st_size + 1, 1 << 16), 1 << 20)
                chunk = os.read(fd, want)
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
                if len(chunk) < want:
                    break  # a short read of a regular file: its end (no second read to see it)
        except OSError as e:
            raise Refused("open", f"cannot read: {e.strerror}") from None
        finally:
            os.close(fd)
        data = b"".join(chunks)
        if len(data) > self.max_bytes:
            raise Refused("too_large", f"over the cap of {self.max_bytes} bytes")
        return data

    def _refuse(self, name: str, e: Refused) -> None:
        old = self.problems.get(name)
        if old is None or (old.reason, old.detail) != (e.reason, e.detail):
            log.warning("snapshot file %s/%s not served: %s", self.path, name, e)
        self.error_counts[e.reason] += 1
        self.problems[name] = FileProblem(name, e.reason, e.detail)

    def count(self, path: str, e: Refused) -> None:
        """A served file's buffer rows failed (`accounting.snapfile.head.buffer_map`): logged and
        counted under `e.reason` (in the next scan's counts); the file stays served (its
        first line is good)."""
        log.warning("snapshot file %s: buffer map not served: %s", path, e)
        with self._lock:
            self.error_counts[e.reason] += 1

    # -- removal and lifetime ----------------------------------------------------------------
    def remove(self, name: str, ident: Ident) -> bool:
        """Remove `name` if it is still the file `ident` names (a dead source superseded by
        a restart); the cached entry goes with it."""
        with self._lock:
            if self._dir is None:
                return False
            try:
                removed = self._dir.remove_if(name, ident[:2])
            except OSError as e:
                log.warning("cannot remove %s/%s: %s", self.path, name, e.strerror)
                return False
            if removed:
                self._cache.pop(name, None)
            return removed

    def free_bytes(self) -> int | None:
        """Bytes an unprivileged writer may still use on the directory's filesystem, or None
        when the directory is not open."""
        with self._lock:
            if self._dir is None:
                return None
            try:
                st = os.fstatvfs(self._dir.fd)
            except OSError:
                return None
            return st.f_bavail * st.f_frsize

    def _shown_problems(self) -> list[FileProblem]:
        """Up to MAX_PROBLEMS_SHOWN problems, the directory's own first."""
        out = sorted(self.problems.values(), key=lambda p: p.name)[:MAX_PROBLEMS_SHOWN]
        if self.skipped:
            detail = f"{self.skipped} files past the first {self.max_files} were not read"
            out.insert(0, FileProblem("", "too_many_files", detail))
        if self.write_problem is not None:
            out.insert(0, self.write_problem)
        if self.directory_problem is not None:
            out.insert(0, FileProblem("", "directory", self.directory_problem))
        return out

    def close(self) -> None:
        with self._lock:
            if self._dir is not None:
                self._dir.close()
                self._dir = None
            self._cache.clear()
            self._loaded.clear()
