"""The config.json a user names with `--config`, read with bounds: a regular file only, at most
`MAX_CONFIG_BYTES`, refused in one line otherwise.

`kvledger serve --config` and `kvledger inspect --config` read the file through
`read_shape(path)`. A device (`/dev/zero`), a FIFO, a socket or a directory is refused
from its `stat` before it is opened, the opened file must be the one that was looked at
(same device and inode, still a regular file), and no more than `MAX_CONFIG_BYTES` + 1
bytes are ever read: a hostile path can neither hang the command nor fill its memory.
The text is then parsed as `kvledger.sglang.dsv4.load_config` parses it, with the same
`ConfigError` messages.
"""

from __future__ import annotations

import json
import os
import stat

from kvledger.sglang.dsv4 import ConfigError, Dsv4Shape, from_dict

# A Hugging Face config.json is a few KiB; a DeepSeek-V4 one with its quantization block ~4 KiB.
MAX_CONFIG_BYTES = 1 << 20


def read_shape(path: str | os.PathLike[str]) -> Dsv4Shape:
    """The DeepSeek-V4 shape in the config at `path`. Raises ConfigError naming the path and
    what was expected."""
    p = os.fspath(path)
    data = _read_bounded(p)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"config {p!r}: not UTF-8 text, expected JSON") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"config {p!r}: invalid JSON at line {e.lineno} column {e.colno} ({e.msg})"
        ) from None
    return from_dict(value, source=p)


def _refuse_kind(p: str, st: os.stat_result) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"config {p!r}: is a directory, expected a config.json file")
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(
            f"config {p!r}: not a regular file (a device, FIFO or socket), expected a "
            "config.json file"
        )
    if st.st_size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config {p!r}: {st.st_size} bytes, expected a config.json of at most "
            f"{MAX_CONFIG_BYTES} bytes"
        )


def _read_bounded(p: str) -> bytes:
    try:
        before = os.stat(p)
    except FileNotFoundError:
        raise ConfigError(
            f"config {p!r}: no such file, expected a Hugging Face config.json"
        ) from None
    except OSError as e:
        raise ConfigError(f"config {p!r}: cannot read it ({e.strerror})") from None
    _refuse_kind(p, before)
    try:
        # O_NONBLOCK: a FIFO swapped in after the stat opens at once instead of waiting for a writer.
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"config {p!r}: cannot read it ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        _refuse_kind(p, st)
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise ConfigError(f"config {p!r}: replaced while being opened, expected a stable file")
        try:
            data = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise ConfigError(f"config {p!r}: cannot read it ({e.strerror})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config {p!r}: more than {MAX_CONFIG_BYTES} bytes, expected a config.json of at "
            f"most {MAX_CONFIG_BYTES} bytes"
        )
    return data
