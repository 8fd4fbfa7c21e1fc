"""load_config: a --config path is read only when it is a small regular file."""

from __future__ import annotations

import os

import pytest

from kvledger.engines.sglang.dsv4 import ConfigError, load_config
from kvledger.engines.sglang.dsv4.shape import MAX_CONFIG_BYTES, from_dict
from tests.kvledger.engines.sglang.dsv4.fixtures import FLASH_CONFIG as FLASH
from tests.kvledger.engines.sglang.dsv4.fixtures import flash_config_dict


def test_reads_what_from_dict_reads():
    assert load_config(FLASH) == from_dict(flash_config_dict(), source=str(FLASH))


def test_a_link_to_a_config_is_fine(tmp_path):
    (tmp_path / "c.json").symlink_to(FLASH)
    shape = load_config(tmp_path / "c.json")
    assert shape.compress_ratios == load_config(FLASH).compress_ratios


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: os.mkfifo(p), "not a regular file"),
        (lambda p: p.symlink_to("/dev/zero"), "not a regular file"),
        (lambda p: p.mkdir(), "is a directory"),
        (lambda p: p.write_bytes(b"{" * (MAX_CONFIG_BYTES + 1)), f"{MAX_CONFIG_BYTES + 1} bytes"),
        (lambda p: p.write_bytes(b"\xff\xfe"), "not UTF-8"),
        (lambda p: p.write_text("{"), "invalid JSON at line 1"),
        (lambda p: p.write_text("[]"), "expected a JSON object"),
        (lambda p: None, "no such file"),
    ],
    ids=[
        "fifo",
        "device",
        "directory",
        "too-large",
        "not-utf8",
        "bad-json",
        "not-object",
        "missing",
    ],
)
def test_refused_in_one_line_naming_the_path(tmp_path, make, expected):
    path = tmp_path / "config.json"
    make(path)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert expected in str(e.value) and str(path) in str(e.value)
    assert "\n" not in str(e.value)
