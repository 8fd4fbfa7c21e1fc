"""accounting.snapfile.reader: a scan of the snapshot directory says why no publisher could
write there now (issue 43 finding 4), and stops saying it once that no longer holds."""

from __future__ import annotations

import os
import time

import pytest

from accounting.snapfile.reader import NO_SPACE_MIN_BYTES, SnapshotFiles
from accounting.snapfile.writer import Publisher


def _statvfs(*, bavail: int = 1 << 20, files: int = 1000, favail: int = 900, flag: int = 0):
    return os.statvfs_result(
        (4096, 4096, 1 << 21, bavail, bavail, files, favail, favail, flag, 255)
    )


@pytest.mark.parametrize(
    "fs, writable, reason, needle",
    [
        (_statvfs(favail=0), True, "no_inodes", "no inode left (0 of 1000)"),
        (_statvfs(flag=os.ST_RDONLY), True, "read_only", "mounted read-only"),
        (_statvfs(flag=os.ST_RDONLY, favail=0), False, "read_only", "read-only"),  # the cause
        (_statvfs(), False, "permission", "does not let uid"),
        (_statvfs(bavail=0), True, "no_space", "0 bytes free"),
    ],
)
def test_a_directory_no_publisher_can_write_names_its_cause_while_it_holds(
    tmp_path, monkeypatch, fs, writable, reason, needle
):
    files = SnapshotFiles(tmp_path, lambda head, path: head)
    try:
        assert files.scan(0.0).write_problem is None
        with monkeypatch.context() as m:
            m.setattr(os, "fstatvfs", lambda fd: fs)
            m.setattr(os, "access", lambda *a, **k: writable)
            scan = files.scan(0.0)
        problem = scan.write_problem
        assert problem is not None and (problem.name, problem.reason) == ("", reason), problem
        assert needle in problem.detail, problem.detail
        assert scan.problems[0] == problem and scan.directory_problem is None
        again = files.scan(0.0)  # fixed: gone at the next scan
        assert again.write_problem is None and again.problems == ()
    finally:
        files.close()


def test_no_space_is_less_room_than_the_largest_file_served(tmp_path, monkeypatch):
    """Room for NO_SPACE_MIN_BYTES is not enough when a source's file is larger: a byte
    short of the largest file served is no space, exactly that much is room."""
    from tests.ledgers import small_ledger

    with small_ledger() as sl, Publisher(sl.ledger, tmp_path, interval=1000) as pub:
        need = os.path.getsize(pub.path)
        assert need > NO_SPACE_MIN_BYTES
        files = SnapshotFiles(tmp_path, lambda head, path: head)
        try:
            for free, reason in ((need - 1, "no_space"), (need, None)):
                fs = os.statvfs_result((4096, 1, 1 << 30, free, free, 1000, 900, 900, 0, 255))
                with monkeypatch.context() as m:
                    m.setattr(os, "fstatvfs", lambda fd, fs=fs: fs)
                    m.setattr(os, "access", lambda *a, **k: True)
                    scan = files.scan(time.time())
                assert len(scan.served) == 1
                got = scan.write_problem
                assert (got.reason if got else None) == reason, got
                if got is not None:
                    assert (
                        f"has {free} bytes free" in got.detail and f"({need} bytes)" in got.detail
                    )
        finally:
            files.close()


@pytest.mark.parametrize("other_user, group_writable", [(True, False), (False, True)])
def test_permission_is_told_only_where_this_users_access_tells_the_publishers(
    tmp_path, monkeypatch, other_user, group_writable
):
    """Root's directory read by another user is written by root's publishers, a group's by
    its members: this user's lack of write access says nothing of theirs, so it is no
    write problem there (the gauge would otherwise stay 0 on a working deployment)."""
    files = SnapshotFiles(tmp_path, lambda head, path: head, group_writable=group_writable)
    try:
        with monkeypatch.context() as m:
            m.setattr(os, "access", lambda *a, **k: False)
            if other_user:
                euid = os.stat(tmp_path).st_uid + 1000
                m.setattr(os, "geteuid", lambda: euid)
            assert not files.permission_checked
            assert files.scan(time.time()).write_problem is None
        assert files.permission_checked is (not group_writable)
    finally:
        files.close()
