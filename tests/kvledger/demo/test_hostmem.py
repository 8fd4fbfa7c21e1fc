"""kvledger.demo.hostmem: the smaller of MemAvailable and the cgroup's room, from files in the kernel's
formats (written here under tmp_path)."""

from __future__ import annotations

from pathlib import Path

from kvledger.demo import hostmem

MEMINFO = "MemTotal:       24683584 kB\nMemFree:  1000 kB\nMemAvailable:   2000000 kB\n"


def _meminfo(tmp_path: Path, text: str = MEMINFO) -> Path:
    p = tmp_path / "meminfo"
    p.write_text(text)
    return p


def _cgroup(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    root.mkdir(exist_ok=True)
    return root


def test_meminfo_alone(tmp_path):
    got = hostmem.available(_meminfo(tmp_path), tmp_path / "no-cgroup")
    assert got == hostmem.Available(2000000 * 1024, f"MemAvailable in {tmp_path / 'meminfo'}")


def test_a_cgroup_v2_limit_below_memavailable_binds(tmp_path):
    root = _cgroup(
        tmp_path,
        {
            "memory.max": "1073741824\n",
            "memory.current": "536870912\n",
            "memory.stat": "anon 1\ninactive_file 268435456\nactive_file 5\n",
        },
    )
    got = hostmem.available(_meminfo(tmp_path), root)
    # 1 GiB limit less (512 MiB used - 256 MiB inactive file cache)
    assert got == hostmem.Available(768 << 20, "the cgroup's memory.max less its use")


def test_a_cgroup_v1_limit(tmp_path):
    root = _cgroup(
        tmp_path,
        {
            "memory/memory.limit_in_bytes": "1073741824\n",
            "memory/memory.usage_in_bytes": "1073741824\n",
            "memory/memory.stat": "total_inactive_file 0\n",
        },
    )
    got = hostmem.available(_meminfo(tmp_path), root)
    assert got == hostmem.Available(0, "the cgroup's memory.limit_in_bytes less its use")


def test_no_limit_and_garbage_are_ignored(tmp_path):
    root = _cgroup(
        tmp_path,
        {
            "memory.max": "max\n",
            "memory.current": "5\n",
            "memory/memory.limit_in_bytes": "9223372036854771712\n",
            "memory/memory.usage_in_bytes": "5\n",
        },
    )
    got = hostmem.available(_meminfo(tmp_path), root)
    assert got is not None and got.source.startswith("MemAvailable")
    bad = _meminfo(tmp_path, "MemAvailable: lots kB\n")
    assert hostmem.available(bad, root) is None


def test_this_machine_has_a_figure():
    got = hostmem.available()
    assert got is not None and got.bytes > 0
