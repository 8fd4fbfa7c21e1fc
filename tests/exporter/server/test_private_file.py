"""`exporter.server.private_file`: one checked read for the token and the web config's files; the
caller's error class, its `where` and its mode rules' words, in the order given."""

from __future__ import annotations

import os

import pytest

from exporter.server import private_file
from exporter.server.private_file import ModeRule


class _Refused(ValueError):
    pass


WRITE = ModeRule(0o022, "lets its group or others write it", "none to", "go-w")
READ = ModeRule(0o004, "lets others read it", "0600 or 0640", "600")


def _file(tmp_path, data: bytes, mode: int) -> str:
    path = tmp_path / "f"
    path.write_bytes(data)
    os.chmod(path, mode)
    return str(path)


def _read(path: str, *, limit: int = 16, modes=(WRITE, READ), too_big=None) -> bytes:
    with private_file.opened(
        path, f"--flag {path}", limit=limit, modes=modes, error=_Refused, too_big=too_big
    ) as (data, _):
        return data


def test_the_first_rule_a_mode_breaks_names_it(tmp_path):
    path = _file(tmp_path, b"x", 0o666)  # breaks both: the first is named
    with pytest.raises(_Refused) as e:
        _read(path)
    assert str(e.value) == (
        f"--flag {path}: mode 0666 lets its group or others write it; expected none to: "
        f"chmod go-w {path}"
    )
    os.chmod(path, 0o644)
    with pytest.raises(_Refused, match=r"mode 0644 lets others read it; expected 0600 or 0640"):
        _read(path)
    assert _read(path, modes=(WRITE,)) == b"x"  # a rule not given is not applied


def test_size_bound_with_the_callers_words(tmp_path):
    path = _file(tmp_path, b"x" * 17, 0o600)
    with pytest.raises(_Refused, match=r": 17 bytes, expected at most 16$"):
        _read(path)
    with pytest.raises(_Refused, match=r": 17 bytes, expected a token$"):
        _read(path, too_big="a token")
    assert _read(path, limit=17) == b"x" * 17


def test_opened_yields_the_checked_descriptor_and_closes_it(tmp_path):
    path = _file(tmp_path, b"abc", 0o600)
    with private_file.opened(path, "w", limit=8, modes=(WRITE,), error=_Refused) as (data, fd):
        assert data == b"abc"
        assert os.path.samestat(os.fstat(fd), os.stat(path))
    with pytest.raises(OSError):
        os.fstat(fd)


def test_not_regular_missing_and_bad_arguments(tmp_path):
    with pytest.raises(_Refused, match=r"^--flag /dev/zero: not a regular file$"):
        _read("/dev/zero")
    with pytest.raises(_Refused, match=r"^--flag /nonexistent/f: No such file"):
        _read("/nonexistent/f")
    with pytest.raises(ValueError, match=r"read limit=0, expected a positive int"):
        _read(_file(tmp_path, b"", 0o600), limit=0)
    with pytest.raises(ValueError, match=r"mask=0o0, expected mode bits"):
        ModeRule(0, "", "", "")
    with pytest.raises(TypeError, match=r"mask=True, expected an int"):
        ModeRule(True, "", "", "")
