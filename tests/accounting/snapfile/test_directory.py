from __future__ import annotations

import os
import stat

import pytest

from accounting.snapfile import directory
from accounting.snapfile.directory import SnapshotDir, SnapshotDirError, default_snapshot_dir
from tests.hostile import as_nobody, nobody_uid, shared_tmp


def test_created_0700_and_operations_stay_inside(tmp_path):
    d = tmp_path / "snap"
    with SnapshotDir(d) as sd:
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
        sd.write_replace("a.json", b"one")
        assert (d / "a.json").read_bytes() == b"one"
        assert stat.S_IMODE(os.stat(d / "a.json").st_mode) == 0o600
        assert [e.name for e in sd.names()] == ["a.json"]  # no temporary left
    assert sd.closed
    sd.close()  # idempotent


def test_a_moved_path_cannot_redirect_writes(tmp_path):
    d, elsewhere = tmp_path / "snap", tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    with SnapshotDir(d) as sd:
        os.rename(d, tmp_path / "moved")
        os.symlink(elsewhere, d)  # the path now leads somewhere else
        sd.write_replace("a.json", b"x")
        assert sd.moved()
        assert os.listdir(elsewhere) == []
        assert (tmp_path / "moved" / "a.json").read_bytes() == b"x"
        with pytest.raises(SnapshotDirError, match="symbolic link"):
            sd.reopen()
        assert not sd.closed  # the checked descriptor is kept when a reopen is refused


def test_link_at_the_final_name_is_replaced_not_followed(tmp_path):
    canary = tmp_path / "canary"
    canary.write_bytes(b"keep")
    with SnapshotDir(tmp_path / "snap") as sd:
        os.symlink(canary, tmp_path / "snap" / "a.json")
        sd.write_replace("a.json", b"new")
        assert canary.read_bytes() == b"keep"
        assert not os.path.islink(tmp_path / "snap" / "a.json")


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o702])
def test_writable_by_others_is_refused_with_one_line(tmp_path, mode):
    d = tmp_path / "snap"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(SnapshotDirError) as e:
        SnapshotDir(d)
    assert "\n" not in str(e.value) and f"{mode:04o}" in str(e.value)


def test_group_mode_allows_group_write_only(tmp_path):
    d = tmp_path / "snap"
    with SnapshotDir(d, group_writable=True) as sd:
        assert stat.S_IMODE(os.fstat(sd.fd).st_mode) == 0o770
        sd.write_replace("a.json", b"x")
        assert stat.S_IMODE(os.stat(d / "a.json").st_mode) == 0o640
    os.chmod(d, 0o772)
    with pytest.raises(SnapshotDirError, match="writable by others"):
        SnapshotDir(d, group_writable=True)


def test_a_symlinked_directory_is_refused(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    os.symlink(tmp_path / "real", tmp_path / "snap")
    with pytest.raises(SnapshotDirError, match="symbolic link"):
        SnapshotDir(tmp_path / "snap")


def test_missing_without_create_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        SnapshotDir(tmp_path / "nope", create=False)


def test_remove_if_removes_only_its_own_file(tmp_path):
    with SnapshotDir(tmp_path / "snap") as sd:
        mine = sd.write_replace("a.json", b"1")
        sd.write_replace("a.json", b"2")  # someone replaced it since
        assert not sd.remove_if("a.json", mine)
        assert (tmp_path / "snap" / "a.json").exists()
        st = os.stat(tmp_path / "snap" / "a.json")
        assert sd.remove_if("a.json", (st.st_dev, st.st_ino))
        assert not (tmp_path / "snap" / "a.json").exists()


@pytest.mark.parametrize("name", ["", "../x", "a/b", ".", ".."])
def test_names_outside_the_directory_are_refused(tmp_path, name):
    with SnapshotDir(tmp_path / "snap") as sd, pytest.raises(ValueError, match="plain name"):
        sd.write_replace(name, b"x")


def test_default_is_the_private_runtime_dir_when_there_is_one(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    assert default_snapshot_dir() == str(run / "kvledger")
    os.chmod(run, 0o755)  # not private: fall back to the temp dir with the uid
    assert default_snapshot_dir().endswith(f"kvledger-{os.geteuid()}")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "relative/path")
    assert default_snapshot_dir().endswith(f"kvledger-{os.geteuid()}")


@pytest.mark.skipif(nobody_uid() is None, reason="needs root and a 'nobody' user")
def test_a_directory_another_user_created_first_is_refused(monkeypatch):
    """Another user pre-creates the predictable default name: refused, never used."""
    with shared_tmp() as tmp:
        d = tmp / f"kvledger-{os.geteuid()}"
        as_nobody(f"import os; os.mkdir({str(d)!r}, 0o700)")
        monkeypatch.setattr(directory.tempfile, "gettempdir", lambda: str(tmp))
        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
        assert default_snapshot_dir() == str(d)
        with pytest.raises(SnapshotDirError) as e:
            SnapshotDir(d)
        assert f"owned by uid {nobody_uid()}" in str(e.value) and "\n" not in str(e.value)
        assert os.listdir(d) == []  # nothing written into it
