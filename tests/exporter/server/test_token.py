"""`exporter.server.token.load_token`: the bearer token from a private file or the environment; every
refusal one line naming the file (or variable) and the rule."""

from __future__ import annotations

import os

import pytest

from exporter.server import token
from exporter.server.token import TokenError, load_token


def _file(tmp_path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / "token"
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o400])
def test_a_private_file_gives_its_token_stripped(tmp_path, mode):
    path = _file(tmp_path, "  s3cret\n", mode)
    assert load_token(path, {token.ENV: "ignored"}) == "s3cret"


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o620, 0o602, 0o660])
def test_a_file_others_read_or_its_group_writes_is_refused(tmp_path, mode):
    path = _file(tmp_path, "s3cret", mode)
    with pytest.raises(TokenError) as e:
        load_token(path, {})
    assert str(e.value) == (
        f"--token-file {path}: mode {mode:04o} lets others read or its group write it; "
        f"expected 0600 or 0640: chmod 600 {path}"
    )


def test_the_environment_when_no_file(tmp_path):
    assert load_token(None, {token.ENV: " abc\t"}) == "abc"
    assert load_token(None, {}) is None
    with pytest.raises(TokenError, match=rf"^\${token.ENV}: empty, expected a token$"):
        load_token(None, {token.ENV: "   "})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty, expected a token"),
        ("two words", "expected printable ASCII without spaces"),
        ("x" * (token.MAX_BYTES + 1), f"{token.MAX_BYTES + 1} bytes, expected a token"),
    ],
)
def test_bad_contents_are_refused_naming_the_file(tmp_path, text, message):
    path = _file(tmp_path, text)
    with pytest.raises(TokenError) as e:
        load_token(path, {})
    assert str(e.value) == f"--token-file {path}: {message}"


def test_not_ascii_missing_and_not_regular(tmp_path):
    path = tmp_path / "token"
    path.write_bytes("s3cr\u00e9t".encode())
    os.chmod(path, 0o600)
    with pytest.raises(TokenError, match=r": expected printable ASCII$"):
        load_token(str(path), {})
    with pytest.raises(TokenError, match=r"^--token-file /nonexistent/token: No such file"):
        load_token("/nonexistent/token", {})
    with pytest.raises(TokenError, match=rf"^--token-file {tmp_path}: not a regular file$"):
        load_token(str(tmp_path), {})


def test_a_link_is_followed_to_a_private_file(tmp_path):
    """A mounted Kubernetes Secret is a chain of links to the file."""
    target = _file(tmp_path, "s3cret")
    link = tmp_path / "link"
    link.symlink_to(target)
    assert load_token(str(link), {}) == "s3cret"
