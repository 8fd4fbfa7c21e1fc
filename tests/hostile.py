"""Another local user for tests: run code as `nobody` (only possible when the tests run as root)."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

# The system's Python: nobody cannot reach a venv under /root. The code run needs only stdlib.
SYSTEM_PYTHON = "/usr/bin/python3"


def nobody_uid() -> int | None:
    """nobody's uid when this process can switch to it (root), else None."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return None


def as_nobody(code: str, timeout: float = 30) -> None:
    """Run `python -c code` as nobody (its group too); raise with its stderr if it fails."""
    entry = pwd.getpwnam("nobody")

    def drop() -> None:
        os.setgroups([])
        os.setgid(entry.pw_gid)
        os.setuid(entry.pw_uid)

    proc = subprocess.run(
        [SYSTEM_PYTHON, "-I", "-c", code],
        preexec_fn=drop,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
    )
    if proc.returncode != 0:
        raise RuntimeError(f"as nobody: {code!r} failed: {proc.stderr.strip()}")


@contextlib.contextmanager
def shared_tmp() -> Iterator[Path]:
    """A fresh directory like /tmp (mode 1777: anyone may create, only owners remove),
    removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="kvledger-shared-", dir="/tmp"))
    try:
        os.chmod(d, 0o1777)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
