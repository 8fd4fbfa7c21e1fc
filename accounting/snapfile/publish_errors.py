"""Why a publish failed: one reason from a fixed set, counted by the publisher and carried
in its file, so that a source that goes stale can say why.

The publisher counts each failed publish under a reason (`REASONS`) and keeps the last
one (`LastError`: reason, a one-line detail, when); both ride in the envelope of every
file it publishes (`publish_errors`, `last_error`), so a publisher that fails now and
then, or that recovers, shows what happened. While it cannot write at all (a full
disk), the exporter sees only a silent source: it then looks at the directory's
filesystem itself (`exporter.sources`) and gives the stale source a `no_space` last
error of its own when there is no room for that source's file.
"""

from __future__ import annotations

import errno
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

REASONS = (
    "no_space",  # ENOSPC or EDQUOT: the filesystem or the quota is full
    "permission",  # EACCES, EPERM, EROFS
    "directory",  # the directory was replaced by one the rules refuse, or removed
    "other",  # anything else (the log has the traceback)
)
MAX_DETAIL = 200
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
_PERMISSION = {errno.EACCES, errno.EPERM, errno.EROFS}


def reason_of(e: BaseException) -> str:
    """The reason a publish failed with `e`."""
    from accounting.snapfile.directory import SnapshotDirError

    if isinstance(e, SnapshotDirError):
        return "directory"
    if isinstance(e, OSError):
        if e.errno in _NO_SPACE:
            return "no_space"
        if e.errno in _PERMISSION:
            return "permission"
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return "directory"
    return "other"


def detail_of(e: BaseException) -> str:
    """`e` as one line of at most MAX_DETAIL characters."""
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text}"[:MAX_DETAIL]


@dataclass(frozen=True)
class LastError:
    reason: str  # one of REASONS
    detail: str  # one line
    at: float  # Unix time

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "detail": self.detail, "at": self.at}


Counts = tuple[tuple[str, int], ...]  # (reason, failures so far), in REASONS order


def counts_of(counts: Mapping[str, int]) -> Counts:
    return tuple((r, int(counts.get(r, 0))) for r in REASONS)


def parse(env: Mapping[str, Any], where: str) -> tuple[Counts, LastError | None]:
    """(`publish_errors`, `last_error`) of a first line's envelope, checked; both optional
    (files of older publishers have neither). Raises the "schema" Refused."""
    from accounting.snapfile.refusal import fail

    raw = env.get("publish_errors")
    counts: dict[str, int] = {}
    if raw is not None:
        if not isinstance(raw, dict) or len(raw) > len(REASONS):
            raise fail(where, "publish_errors: expected an object of reason -> count")
        for reason, n in raw.items():
            if reason not in REASONS:
                raise fail(
                    where, f"publish_errors: reason {reason!r:.60}, expected one of {REASONS}"
                )
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < 2**63:
                raise fail(where, f"publish_errors[{reason}]={n!r:.60}, expected an integer >= 0")
            counts[reason] = n
    last = env.get("last_error")
    if last is None:
        return counts_of(counts), None
    if not isinstance(last, dict):
        raise fail(where, "last_error: expected an object or null")
    reason, detail, at = last.get("reason"), last.get("detail"), last.get("at")
    if reason not in REASONS:
        raise fail(where, f"last_error.reason={reason!r:.60}, expected one of {REASONS}")
    if not isinstance(detail, str) or len(detail) > MAX_DETAIL:
        raise fail(
            where, f"last_error.detail: expected a string of at most {MAX_DETAIL} characters"
        )
    if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at) or at < 0:
        raise fail(where, f"last_error.at={at!r:.60}, expected a finite number >= 0")
    return counts_of(counts), LastError(reason, " ".join(detail.split()), float(at))
