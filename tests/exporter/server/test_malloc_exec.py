"""exporter/server/malloc_exec.py: which jemalloc may be preloaded into kvledger serve (a
library a hostile user could write is refused), the second start's environment, and a real
`kvledger serve --malloc jemalloc` started again under the library (where one is installed:
scripts/test installs Debian's libjemalloc2)."""

from __future__ import annotations

import http.client
import os
import signal

import pytest

from exporter.server import malloc_exec as mx
from exporter.server.errors import UsageError
from kvledger.tools.bench.serve_child import ServeChild

ME = [os.geteuid()]


@pytest.fixture
def private(tmp_path):
    d = tmp_path / "lib"
    d.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)
    lib = d / "libjemalloc.so.2"
    lib.write_bytes(b"\x7fELF not really")
    os.chmod(lib, 0o644)
    return tmp_path, lib


def test_a_file_of_the_user_in_directories_only_it_may_write_is_trusted(private) -> None:
    top, lib = private
    assert mx.refusal(str(lib), ME, top=str(top)) is None


@pytest.mark.parametrize("mode", [0o664, 0o646, 0o666])
def test_a_library_others_may_write_is_refused(private, mode) -> None:
    top, lib = private
    os.chmod(lib, mode)
    why = mx.refusal(str(lib), ME, top=str(top))
    assert why is not None and str(lib) in why and "writable by group or others" in why


def test_a_directory_above_it_others_may_write_is_refused(private) -> None:
    top, lib = private
    os.chmod(lib.parent, 0o1777)  # sticky: still refused
    why = mx.refusal(str(lib), ME, top=str(top))
    assert why is not None and why.startswith(f"{lib.parent}:") and "1777" in why


def test_a_library_of_another_owner_is_refused(private) -> None:
    top, lib = private
    why = mx.refusal(str(lib), [os.geteuid() + 1], top=str(top))
    assert why is not None and f"owned by uid {os.geteuid()}" in why


def test_a_link_is_judged_by_what_it_points_at(private, tmp_path) -> None:
    top, lib = private
    bad = tmp_path / "evil.so"
    bad.write_bytes(b"x")
    os.chmod(bad, 0o666)
    link = lib.parent / "libjemalloc-link.so.2"
    link.symlink_to(bad)
    why = mx.refusal(str(link), ME, top=str(top))
    assert why is not None and str(bad) in why


def test_missing_and_not_regular_are_refused_by_name(private) -> None:
    top, lib = private
    assert "No such file" in (mx.refusal(str(lib) + ".gone", ME, top=str(top)) or "")
    assert "not a regular file" in (mx.refusal(str(lib.parent), ME, top=str(top)) or "")


def test_find_takes_the_first_trusted_and_says_why_the_others_were_passed_over(private) -> None:
    top, lib = private
    bad = lib.parent / "other.so"
    bad.write_bytes(b"x")
    os.chmod(bad, 0o666)
    found, why = mx.find_jemalloc([str(lib) + ".gone", str(bad), str(lib)], ME, str(top))
    assert found == str(lib)
    assert len(why) == 2 and "No such file" in why[0] and str(bad) in why[1]
    assert mx.find_jemalloc([str(bad)], ME, str(top)) == (None, [why[1]])


def test_the_second_start_preloads_the_library_before_any_other_and_keeps_a_set_conf() -> None:
    env = mx.environment("/lib/j.so", {"LD_PRELOAD": "/lib/other.so", "PATH": "/bin"})
    assert env["LD_PRELOAD"] == "/lib/j.so:/lib/other.so"
    assert env["PYTHONMALLOC"] == "malloc" and env["MALLOC_CONF"] == mx.DEFAULT_CONF
    assert env["PATH"] == "/bin" and mx.second_start(env)
    assert mx.environment("/lib/j.so", {"MALLOC_CONF": "narenas:1"})["MALLOC_CONF"] == "narenas:1"
    assert mx.environment("/lib/j.so", {})["LD_PRELOAD"] == "/lib/j.so"
    assert not mx.second_start({})


def test_loaded_reads_the_maps(tmp_path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1234   /lib/j.so\n")
    assert mx.loaded("/lib/j.so", str(maps)) is True
    assert mx.loaded("/lib/other.so", str(maps)) is False
    assert mx.loaded("/lib/j.so", str(tmp_path / "none")) is None


def test_inside_another_program_serve_refuses_to_start_itself_again() -> None:
    from kvledger.serve import _choose_malloc

    _choose_malloc("python")  # nothing to do
    with pytest.raises(UsageError, match="--malloc jemalloc"):
        _choose_malloc("jemalloc")  # pytest is not `kvledger`: refused, never exec'd


def test_serve_with_jemalloc_runs_under_it_and_stops_cleanly(tmp_path) -> None:
    library, why = mx.find_jemalloc()
    if library is None:
        pytest.skip(f"no trusted jemalloc here ({'; '.join(why)})")
    d = tmp_path / "snap"
    args = ["--no-demo", "--port", "0", "--snapshot-dir", str(d), "--malloc", "jemalloc"]
    with ServeChild(args) as server:
        pid = server.proc.pid
        with open(f"/proc/{pid}/maps") as f:
            assert any(line.rstrip().endswith(library) for line in f)
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        assert env[b"PYTHONMALLOC"] == b"malloc" and env[b"KVLEDGER_MALLOC"] == b"jemalloc"
        host, port = server.url.split("//", 1)[1].rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", "/healthz")
        assert conn.getresponse().status == 200
        conn.close()
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(15) == 0  # the same pid: started again, not forked
