"""exporter.compression: one ordinary gzip member from either backend, the same text back."""

from __future__ import annotations

import gzip
import platform
import zlib

import pytest

from exporter import compression

# A /metrics-like body: repetitive labels, changing values, over one deflate window.
BODY = b"".join(
    b'sglang:kv_cache_held_slots{family="f%d",holder="h%d",tp_rank="%d"} %d\n'
    % (i % 7, i % 4, i % 8, i * 7919)
    for i in range(4000)
)


@pytest.fixture(params=["isal", "zlib"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "zlib":
        monkeypatch.setattr(compression, "_isal", None)
    elif compression._isal is None:
        pytest.skip("isal is not installed on this machine")
    return request.param


def _after_first_member(data: bytes) -> bytes:
    """What follows the first gzip member of `data` (which must end)."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    d.decompress(data)
    assert d.eof, "the member does not end"
    return d.unused_data


def test_one_member_mtime_0_that_gives_the_body_back(backend: str) -> None:
    out = compression.gzip_body(BODY)
    assert out[:2] == b"\x1f\x8b" and out[2] == 8  # gzip, deflate
    assert out[4:8] == b"\0\0\0\0"  # mtime 0: the bytes depend on the text only
    assert _after_first_member(out) == b""  # one member, nothing after it
    assert gzip.decompress(out) == BODY
    assert len(out) < len(BODY) // 4
    assert compression.gzip_body(BODY) == out


def test_empty_and_tiny_bodies(backend: str) -> None:
    for data in (b"", b"x", b"# EOF\n"):
        assert gzip.decompress(compression.gzip_body(data)) == data


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"),
    reason="isal is a dependency only where it publishes wheels",
)
def test_isal_is_what_an_install_uses_where_it_has_wheels() -> None:
    # pyproject names isal for these machines: an install without it (a dropped or mistyped
    # dependency) would fall back to zlib's 8x slower gzip without a word.
    assert compression.BACKEND == "isal"
