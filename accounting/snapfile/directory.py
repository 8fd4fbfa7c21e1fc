"""The snapshot directory: where it lives, the rules it must meet, and I/O relative to it.

Publishers (engine processes) write one file each into the directory; the exporter
reads them. On a shared host (`docs/security.md`) another local user can create
files and directories in `/tmp`, race any predictable name and plant links, FIFOs
or devices. So the directory is a trust boundary, handled the way node_exporter's
textfile collector handles its own: only a directory its owner controls is used.

Rules, checked on the opened directory (never on a path that could be swapped):
- owned by the user of this process or by root; any other owner is refused, always;
- not writable by group or others (mode & 0o022 == 0), unless `group_writable` is
  given, which allows group write (a group of engine users publishing into one
  directory) and still refuses write by others;
- a real directory, not a symbolic link to one;
- every directory above it owned by this user or root and writable by no one else,
  unless its sticky bit is set (as `/tmp`'s is: others may create entries there but not
  rename or remove ours); group write is allowed above it in group mode. Otherwise
  another user could replace the directory, or a parent, after the checks.
A directory kvledger creates is created 0700 (0770 in group mode); missing parents are
created 0755, whatever the umask.

`SnapshotDir` opens the directory once (O_DIRECTORY | O_NOFOLLOW) and does every
operation relative to that descriptor (`dir_fd=`), so renaming or replacing the
path afterwards cannot redirect a write. If the path stops naming the directory
(a temp cleaner removed it), `reopen()` opens it again under the same rules.

`default_snapshot_dir()` is `$XDG_RUNTIME_DIR/kvledger` when `$XDG_RUNTIME_DIR` is a
private directory of ours, else `<tempdir>/kvledger-<uid>`. The second name is
predictable: another user can create it first, and then it is refused (one line,
naming the owner), never used.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
import tempfile
from collections.abc import Iterator

DIR_MODE = 0o700
PARENT_MODE = 0o755
GROUP_DIR_MODE = 0o770
FILE_MODE = 0o600
GROUP_FILE_MODE = 0o640
TEMP_GRACE_S = 60.0  # a temporary file this old has no live writer (a write takes ms)
# `.<source>.json.<16 hex>.tmp`: the name `write_replace` draws for a file being written.
_TEMP_NAME = re.compile(r"\.(?P<final>[^/\x00]+)\.[0-9a-f]{16}\.tmp")
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW | _O_CLOEXEC


class SnapshotDirError(ValueError):
    """The snapshot directory breaks a rule; the message is one line naming it and why."""


def trusted_owners() -> frozenset[int]:
    """Owners whose directories and files are trusted: this process's user and root."""
    return frozenset({os.geteuid(), 0})


def default_snapshot_dir() -> str:
    """The per-user default: `$XDG_RUNTIME_DIR/kvledger` if that runtime dir is ours and
    private, else `<tempdir>/kvledger-<uid>` (created 0700 and checked when opened)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        try:
            st = os.stat(runtime, follow_symlinks=False)
        except OSError:
            st = None
        if (
            st is not None
            and stat.S_ISDIR(st.st_mode)
            and st.st_uid == os.geteuid()
            and st.st_mode & 0o077 == 0
        ):
            return os.path.join(runtime, "kvledger")
    return os.path.join(tempfile.gettempdir(), f"kvledger-{os.geteuid()}")


def check_dir_stat(path: str, st: os.stat_result, *, group_writable: bool = False) -> None:
    """Raise SnapshotDirError (one line) unless `st` is a directory meeting the rules."""
    if not stat.S_ISDIR(st.st_mode):
        raise SnapshotDirError(f"snapshot directory {path}: not a directory")
    if st.st_uid not in trusted_owners():
        raise SnapshotDirError(
            f"snapshot directory {path}: owned by uid {st.st_uid}, expected uid "
            f"{os.geteuid()} (this user) or root; refusing a directory another user controls "
            "(remove it or pick another --snapshot-dir)"
        )
    writable = st.st_mode & (0o002 if group_writable else 0o022)
    if writable:
        who = "others" if st.st_mode & 0o002 else "its group"
        hint = "" if group_writable else " (or --snapshot-dir-group-writable for a shared group)"
        raise SnapshotDirError(
            f"snapshot directory {path}: mode {stat.S_IMODE(st.st_mode):04o} is writable by "
            f"{who}; expected {'0770' if group_writable else '0700'} or stricter: "
            f"chmod {'o-w' if group_writable else 'go-w'} {path}{hint}"
        )


def check_parents(path: str, *, group_writable: bool = False) -> None:
    """Raise SnapshotDirError (one line) when a directory above `path` can be written by a
    user other than this one and root (owned by one, or writable by group or others
    without the sticky bit; group write is allowed in group mode)."""
    parent = os.path.dirname(path)
    while True:
        try:
            st = os.stat(parent)  # a link in the path (/var/run) is judged by what it names
        except FileNotFoundError:
            pass
        else:
            sticky = st.st_mode & stat.S_ISVTX
            writable = st.st_mode & (0o002 if group_writable else 0o022)
            if st.st_uid not in trusted_owners():
                raise SnapshotDirError(
                    f"snapshot directory {path}: parent {parent} is owned by uid {st.st_uid}; "
                    f"expected parents of uid {os.geteuid()} (this user) or root (another user "
                    "could replace the directory)"
                )
            if writable and not sticky:
                raise SnapshotDirError(
                    f"snapshot directory {path}: parent {parent} (mode "
                    f"{stat.S_IMODE(st.st_mode):04o}) is writable by "
                    f"{'others' if st.st_mode & 0o002 else 'its group'} without the sticky "
                    "bit; another user could replace the directory: expected parents only "
                    "this user or root can write (chmod go-w, or +t)"
                )
        up = os.path.dirname(parent)
        if up == parent:
            return
        parent = up


def make_parents(path: str) -> None:
    """Create the missing directories above `path`, each 0755 whatever the umask."""
    parent = os.path.dirname(path)
    missing = []
    while not os.path.isdir(parent):
        missing.append(parent)
        up = os.path.dirname(parent)
        if up == parent:
            break
        parent = up
    for d in reversed(missing):
        try:
            os.mkdir(d, PARENT_MODE)
        except FileExistsError:
            continue  # made meanwhile: judged by check_parents like any other
        os.chmod(d, PARENT_MODE, follow_symlinks=False)  # mkdir's mode went through the umask


class SnapshotDir:
    """An open, checked snapshot directory; every operation is relative to its descriptor.

    `create`: make the directory (0700, or 0770 with `group_writable`) when missing;
    without it a missing directory raises FileNotFoundError. Use as a context manager
    or call `close()` (idempotent).
    """

    def __init__(
        self, path: str | os.PathLike[str], *, create: bool = True, group_writable: bool = False
    ) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.group_writable = group_writable
        self.create = create
        self.fd = -1
        self.fd = self._open()

    def _open(self) -> int:
        created = False
        if self.create:
            make_parents(self.path)
        check_parents(self.path, group_writable=self.group_writable)
        if self.create:
            try:
                os.mkdir(self.path, DIR_MODE)
                created = True
            except FileExistsError:
                pass
        try:
            fd = os.open(self.path, _O_DIR)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise SnapshotDirError(
                    f"snapshot directory {self.path}: a symbolic link or not a directory; "
                    "expected a real directory"
                ) from None
            raise
        try:
            if created and self.group_writable:
                os.fchmod(fd, GROUP_DIR_MODE)  # mkdir's mode went through the umask
            check_dir_stat(self.path, os.fstat(fd), group_writable=self.group_writable)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def identity(self) -> tuple[int, int]:
        st = os.fstat(self.fd)
        return st.st_dev, st.st_ino

    def moved(self) -> bool:
        """True when the path no longer names the directory this object holds open."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self.identity()

    def reopen(self) -> None:
        """Open the path again under the same rules (after `moved()`); the old descriptor
        is closed only once the new one passed the checks."""
        fd = self._open()
        old, self.fd = self.fd, fd
        if old >= 0:
            os.close(old)

    # -- writing ---------------------------------------------------------------------------
    def write_replace(self, name: str, data: bytes, *, fsync: bool = False) -> tuple[int, int]:
        """Write `data` to a new file under an unpredictable name (O_CREAT | O_EXCL |
        O_NOFOLLOW) and rename it over `name`, both relative to the directory. A reader
        sees the old file or the new one, never a torn one; a link planted at `name` is
        replaced, never followed. Returns the new file's (st_dev, st_ino)."""
        _check_name(name)
        mode = GROUP_FILE_MODE if self.group_writable else FILE_MODE
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _O_CLOEXEC
        for _ in range(8):
            tmp = f".{name}.{secrets.token_hex(8)}.tmp"
            try:
                fd = os.open(tmp, flags, mode, dir_fd=self.fd)
                break
            except FileExistsError:
                continue
        else:  # pragma: no cover - 8 collisions of 64 random bits
            raise FileExistsError(f"{self.path}: no free temporary name for {name}")
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if fsync:
                    os.fsync(fd)
                st = os.fstat(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.fd)
            raise
        return st.st_dev, st.st_ino

    def remove_stale_temporaries(
        self, now: float, grace: float = TEMP_GRACE_S, final: str | None = None
    ) -> int:
        """Remove the temporary files of writers that are gone: names `write_replace` draws
        (for `final` only, when given), regular files (lstat: a link or anything else is
        left alone, never followed) of this process's user, last modified more than
        `grace` seconds before `now` (wall clock). Returns how many were removed."""
        removed = 0
        uid = os.geteuid()
        for entry in self.names():
            m = _TEMP_NAME.fullmatch(entry.name)
            if m is None or (final is not None and m["final"] != final):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or now - st.st_mtime <= grace:
                continue
            try:
                os.unlink(entry.name, dir_fd=self.fd)
            except FileNotFoundError:
                continue
            removed += 1
        return removed

    def remove_if(self, name: str, identity: tuple[int, int]) -> bool:
        """Remove `name` only if it is still the file `identity` names (so a closing
        publisher removes its own file, never one another put in its place)."""
        _check_name(name)
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if (st.st_dev, st.st_ino) != identity:
            return False
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            return False
        return True

    # -- reading ---------------------------------------------------------------------------
    def names(self) -> Iterator[os.DirEntry[str]]:
        """The directory's entries (lstat-only information; nothing is followed)."""
        with os.scandir(self.fd) as it:
            yield from it

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def open_regular(self, name: str) -> int:
        """An fd to read `name`: O_NOFOLLOW (a link fails with ELOOP) and O_NONBLOCK (a FIFO
        cannot hang the open); the caller checks fstat before reading."""
        _check_name(name)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
        return os.open(name, flags | _O_CLOEXEC, dir_fd=self.fd)

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __enter__(self) -> SnapshotDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def out_of_inodes(fs: os.statvfs_result) -> bool:
    """No inode left for an unprivileged user (`f_favail` 0) on a filesystem that counts
    them (`f_files` > 0; btrfs and some network filesystems report 0), with blocks free: no
    file can be created in it, however much room there is."""
    return fs.f_files > 0 and fs.f_favail == 0 and fs.f_bavail > 0


def _check_name(name: str) -> None:
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise ValueError(f"snapshot file name {name!r}: expected a plain name inside the directory")
