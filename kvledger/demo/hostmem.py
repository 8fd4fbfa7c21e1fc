"""How much memory this process can still take: the kernel's estimate, and its cgroup's limit.

`available()` is the smaller of `MemAvailable` in /proc/meminfo (what the kernel
estimates can be allocated without swapping) and, where the process runs under a
memory-limited cgroup (a container, a systemd unit, a Kubernetes pod), that limit less
what the cgroup already uses (its inactive file cache counted as free, as the kubelet
does). `Available.source` names the figure that bound, for messages.
Only plain numbers are accepted from those files; anything else is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROC_MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")
# A limit at or above this is "no limit" (cgroup v1 writes 2^63 rounded down to a page).
_UNLIMITED = 1 << 60
_MAX_READ = 1 << 16


@dataclass(frozen=True)
class Available:
    bytes: int
    source: str  # e.g. "MemAvailable in /proc/meminfo"


def _read(path: Path) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(_MAX_READ)
    except OSError:
        return None


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    return int(text) if text.isdigit() else None


def _field(text: str | None, key: str) -> int | None:
    """`key value [kB]` from a meminfo- or memory.stat-style file."""
    for line in (text or "").splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[0] == key and parts[1].isdigit():
            return int(parts[1]) * (1024 if parts[2:3] == ["kB"] else 1)
    return None


def _cgroup_room(root: Path) -> Available | None:
    """Limit less working set of the cgroup the process sees at `root` (v2, then v1)."""
    for limit_file, usage_file, inactive_key in (
        ("memory.max", "memory.current", "inactive_file"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "total_inactive_file"),
    ):
        limit = _int(_read(root / limit_file))
        usage = _int(_read(root / usage_file))
        if limit is None or usage is None or limit >= _UNLIMITED:
            continue
        stat = root / Path(limit_file).parent / "memory.stat"
        inactive = _field(_read(stat), inactive_key) or 0
        working_set = max(usage - inactive, 0)
        return Available(
            max(limit - working_set, 0), f"the cgroup's {Path(limit_file).name} less its use"
        )
    return None


def available(meminfo: Path = PROC_MEMINFO, cgroup: Path = CGROUP) -> Available | None:
    """What this process can still allocate, or None when no figure can be read here."""
    found = []
    mem = _field(_read(meminfo), "MemAvailable")
    if mem is not None:
        found.append(Available(mem, f"MemAvailable in {meminfo}"))
    room = _cgroup_room(cgroup)
    if room is not None:
        found.append(room)
    return min(found, key=lambda a: a.bytes) if found else None
