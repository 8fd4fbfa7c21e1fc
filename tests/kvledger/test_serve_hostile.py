"""`kvledger serve` against a hostile host: planted links, FIFOs, devices, huge, deep, wrong
and forged files, a flood of files, and a directory another user created first.

One live `kvledger serve` (real uvicorn, its embedded demo publishing) over a private
snapshot directory, with a second good source published from this process. For each
attack: nothing outside the directory is written (a canary's bytes and mtime), no
forged series is exported, both good sources keep publishing and exporting, `/healthz`
answers fast, and the refused file is named with its reason in /debug/kv and counted.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from accounting.ledger import Ledger
from accounting.snapfile.format import parse
from accounting.snapfile.writer import Publisher
from exporter import metrics as m
from tests.hostile import as_nobody, nobody_uid, shared_tmp
from tests.servers import ServeProcess, repo_env, stop, wait_until

pytestmark = pytest.mark.slow
GOOD = "good-model"
DEMO = "deepseek-v4-flash"


@dataclass
class Rig:
    base: str
    directory: Path
    canary: Path
    canary_stat: os.stat_result
    publisher: Publisher
    demo_name: str

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(f"{self.base}{path}", timeout=5, **kw)

    def headlines(self) -> dict[str, float]:
        """model_name -> headline GiB of every engine series exported."""
        out = {}
        for fam in text_string_to_metric_families(self.get("/metrics").text):
            for s in fam.samples:
                if s.name == m.HEADLINE:
                    out[s.labels["model_name"]] = s.value
        return out

    def sequences(self) -> dict[str, int]:
        return {s["labels"]["model_name"]: s["sequence"] for s in self.debug()["sources"]}

    def debug(self) -> dict:
        return self.get("/debug/kv").json()

    def refused(self) -> dict[str, str]:
        return {p["name"]: p["reason"] for p in self.debug()["files_not_served"]}


@pytest.fixture(scope="module")
def rig(tmp_path_factory) -> Iterator[Rig]:
    root = tmp_path_factory.mktemp("hostile")
    directory = root / "snap"
    canary = root / "canary"
    canary.write_bytes(b"the service user's own file\n")
    os.chmod(canary, 0o600)
    server = ServeProcess(
        [
            "--port",
            "0",
            "--snapshot-dir",
            str(directory),
            "--interval",
            "0.2",
            "--rate",
            "20",
            "--log-interval",
            "3600",
        ]
    )
    demo_name = f"{DEMO}-tp0-pid{server.proc.pid}.json"
    ledger = Ledger({"model_name": GOOD, "tp_rank": "0"})
    publisher = Publisher(ledger, directory, interval=0.2)
    try:
        r = Rig(server.url, directory, canary, os.stat(canary), publisher, demo_name)
        wait_until(lambda: set(r.headlines()) == {GOOD, DEMO}, 20, "both good sources exported")
        yield r
    finally:
        publisher.close()
        assert server.close() == 0


def _plant(rig: Rig, name: str, data: bytes) -> Path:
    path = rig.directory / name
    path.write_bytes(data)
    return path


def _demo_file(rig: Rig) -> tuple[dict, bytes]:
    return parse((rig.directory / rig.demo_name).read_bytes())


def _forged(rig: Rig, name: str, **changes) -> bytes:
    """The demo's own file with `changes`, named for `name` (as a forger would copy it)."""
    envelope, rows = _demo_file(rig)
    envelope = {**envelope, "source": name.removesuffix(".json"), **changes}
    return json.dumps(envelope).encode() + b"\n" + rows


def _with_snapshot(rig: Rig, name: str, **snap_changes) -> bytes:
    envelope, rows = _demo_file(rig)
    snap = {**envelope["snapshot"], **snap_changes}
    envelope = {**envelope, "source": name.removesuffix(".json"), "snapshot": snap}
    return json.dumps(envelope).encode() + b"\n" + rows


def _nan_figures(rig: Rig, name: str) -> bytes:
    """NaN and negative figures where a scrape reads them: the first line."""
    envelope, rows = _demo_file(rig)
    snap = json.loads(json.dumps(envelope["snapshot"]))
    snap["families"]["physical_bytes"][0] = float("nan")  # the first line's columns
    snap["accounts"]["mapped_pages"][0] = -(80 << 30)
    envelope = {**envelope, "source": name.removesuffix(".json"), "snapshot": snap}
    return json.dumps(envelope).encode() + b"\n" + rows


def _inflated(snapshot: dict, figure_bytes: int) -> dict:
    """`snapshot` (a first line's) claiming `figure_bytes` reserved, physical and mapped in
    every family, its totals made to match (so only the labels can give it away)."""
    snap = json.loads(json.dumps(snapshot))
    families = snap["families"]  # columns
    n = len(families["family"])
    for figure in ("reserved_bytes", "physical_bytes", "mapped_bytes"):
        families[figure] = [figure_bytes] * n
        snap["totals"][figure] = figure_bytes * n
    return snap


def _symlinks(rig: Rig) -> dict[str, str]:
    """Links to the canary at every name a publisher writes: its file and the temporary
    names (the fixed one of old and a random-looking one), for both good sources."""
    for final in (rig.demo_name, f"{GOOD}-tp0-pid{os.getpid()}.json"):
        for name in (f".{final}.tmp", f".{final}.0123456789abcdef.tmp"):
            os.symlink(rig.canary, rig.directory / name)
        # At the file's own name: refused while there, replaced (not followed) by the next
        # publish.
        tmp = rig.directory / f"planted-{final}"
        os.symlink(rig.canary, tmp)
        os.replace(tmp, rig.directory / final)
    os.symlink(rig.canary, rig.directory / "canary.json")
    os.symlink("/dev/zero", rig.directory / "zero.json")
    return {"canary.json": "symlink", "zero.json": "symlink"}


def _device(rig: Rig) -> dict[str, str]:
    os.mkfifo(rig.directory / "fifo.json")
    out = {"fifo.json": "not_regular"}
    if os.geteuid() == 0:
        os.mknod(rig.directory / "char.json", 0o600 | 0o020000, os.makedev(1, 5))  # /dev/zero
        out["char.json"] = "not_regular"
    return out


def _oversized(rig: Rig) -> dict[str, str]:
    os.truncate(_plant(rig, "big.json", b""), 1 << 30)
    return {"big.json": "too_large"}


def _then(_done: object, refused: dict[str, str]) -> dict[str, str]:
    """`refused` (file name -> reason), once the attack's step `_done` has run."""
    return refused


ATTACKS: dict[str, Callable[[Rig], dict[str, str]]] = {
    "symlinks": _symlinks,
    "fifo_and_devices": _device,
    "oversized": _oversized,
    "deep_nesting": lambda r: _then(
        _plant(r, "deep.json", b"[" * 200_000 + b"]" * 200_000 + b"\n[]"),
        {"deep.json": "nesting"},
    ),
    "wrong_types": lambda r: _then(
        _plant(r, "types.json", _forged(r, "types.json", interval="1", pid="1")),
        {"types.json": "schema"},
    ),
    "nan_and_negative_figures": lambda r: _then(
        _plant(r, "nan.json", _nan_figures(r, "nan.json")), {"nan.json": "schema"}
    ),
    "future_heartbeat": lambda r: _then(
        _plant(r, "future.json", _forged(r, "future.json", published_at=time.time() + 86400)),
        {"future.json": "schema"},
    ),
    "not_json": lambda r: _then(
        _plant(r, "junk.json", b"\xff\x00garbage\n"), {"junk.json": "parse"}
    ),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_planted_file_is_refused_and_the_good_sources_keep_flowing(rig, attack):
    before = rig.sequences()
    counts_before = _error_counts(rig)
    planted = set(os.listdir(rig.directory))
    expected = ATTACKS[attack](rig)
    try:
        t0 = time.monotonic()
        assert rig.get("/healthz").status_code == 200
        assert time.monotonic() - t0 < 1.0
        wait_until(lambda: expected.items() <= rig.refused().items(), 10, f"{attack} refused")
        wait_until(
            lambda: all(rig.sequences().get(k, -1) > v for k, v in before.items()),
            10,
            "both good sources published again",
        )
        heads = rig.headlines()
        assert set(heads) == {GOOD, DEMO}
        assert heads[DEMO] < 1.0  # the demo's 512 MiB budget, never a forged figure
        counts = _error_counts(rig)
        for reason in set(expected.values()):
            n = sum(1 for v in expected.values() if v == reason)
            assert counts.get(reason, 0) - counts_before.get(reason, 0) >= n, (reason, counts)
        _canary_untouched(rig)
    finally:
        for name in set(os.listdir(rig.directory)) - planted:
            # A publisher's temporary file may be renamed into place between the listing and
            # the unlink: it was not planted, and it is gone.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(rig.directory / name)


def test_a_forged_file_cannot_replace_the_engine_series(rig):
    """Owned by another user: refused. Owned by a trusted user, claiming 80 GiB: refused by
    the first-line checks, or in conflict with the demo. Imitating the demo's engine labels
    with figures that add up: a conflict, neither is exported, and the 80 GiB figure never
    is."""
    forged = _plant(rig, "forged.json", _forged(rig, "forged.json"))
    envelope, rows = _demo_file(rig)
    buffers = json.loads(rows)
    for b in buffers:
        b["physical_bytes"] = b["mapped_bytes"] = 80 << 30
    snap = _inflated(envelope["snapshot"], 80 << 30)
    # Published every 5 s by its word, so that it is still live (in conflict, not stale)
    # however long the owner round below takes on a slow machine (the demo's 0.2 s is stale
    # after 1.6 s).
    forged.write_bytes(
        json.dumps({**envelope, "source": "forged", "interval": 5.0, "snapshot": snap}).encode()
        + b"\n"
        + json.dumps(buffers).encode()
    )
    try:
        uid = nobody_uid()
        if uid is not None:
            os.chown(forged, uid, -1)
            wait_until(lambda: rig.refused().get("forged.json") == "owner", 10, "owner refused")
            assert set(rig.headlines()) == {GOOD, DEMO}
            assert rig.headlines()[DEMO] < 1.0
            os.chown(forged, 0, -1)
            os.utime(forged)  # a new version: read again
        views = lambda: {s["source"]: s for s in rig.debug()["sources"]}  # noqa: E731
        # Refused by the first-line checks where the demo's accounts hold pages that cannot
        # add up to 80 GiB, else read and in conflict with the demo: never exported.
        wait_until(
            lambda: rig.refused().get("forged.json") == "schema" or "forged" in views(),
            10,
            "the 80 GiB file judged",
        )
        assert all(v < 1.0 for v in rig.headlines().values())
        # The demo's own file under another name: figures that add up, the demo's labels.
        envelope, rows = _demo_file(rig)
        forged.write_bytes(
            json.dumps({**envelope, "source": "forged", "interval": 5.0}).encode() + b"\n" + rows
        )
        wait_until(lambda: "forged" in views(), 10, "the forged file is read")
        both = views()
        assert not both["forged"]["up"] and "conflict" in both["forged"]["stale_reason"]
        demo = both[rig.demo_name.removesuffix(".json")]
        assert not demo["up"] and "conflict" in demo["stale_reason"]
        heads = rig.headlines()
        assert DEMO not in heads and all(v < 1.0 for v in heads.values())
        _canary_untouched(rig)
    finally:
        forged.unlink()
    wait_until(lambda: set(rig.headlines()) == {GOOD, DEMO}, 10, "the demo is served again")


def test_bad_buffer_rows_fail_that_sources_buffer_map_only(rig):
    """A trusted owner's file with a good first line (its own engine labels) and NaN,
    negative, then deeply nested buffer rows: served from its first line; the rows are
    checked when /debug/kv asks, fail for that source only, are counted, and never touch
    the good sources' metrics or buffer maps."""
    envelope, rows = _demo_file(rig)
    snap = {**envelope["snapshot"], "labels": {"model_name": "rows-model", "tp_rank": "0"}}
    # Published every 5 s by its word: the source stays up through the checks below (the
    # demo's 0.2 s made its heartbeat stale after 1.6 s, which a slow machine passed).
    envelope = {**envelope, "source": "rows", "interval": 5.0, "snapshot": snap}
    head = json.dumps(envelope).encode()
    buffers = json.loads(rows)
    buffers[0]["physical_bytes"] = float("nan")
    buffers[1]["mapped_bytes"] = -(80 << 30)
    planted = _plant(rig, "rows.json", head + b"\n" + json.dumps(buffers).encode())
    try:
        for second_line, expected in (
            (json.dumps(buffers).encode(), "schema: buffers[0]: physical_bytes=nan"),
            (b"[" * 200_000 + b"]" * 200_000, "nesting:"),
        ):
            before = _error_counts(rig).get("buffers", 0)
            head = json.dumps({**envelope, "published_at": time.time()}).encode()
            planted.write_bytes(head + b"\n" + second_line)
            os.utime(planted, ns=(time.time_ns(), time.time_ns()))  # a new version
            t0 = time.monotonic()
            assert rig.get("/healthz").status_code == 200
            assert time.monotonic() - t0 < 1.0

            def shown() -> dict[str, dict]:
                return {s["labels"]["model_name"]: s for s in rig.debug()["sources"]}

            wait_until(
                lambda e=expected: (
                    (shown().get("rows-model") or {}).get("buffers_error", "")
                    and shown()["rows-model"]["buffers_error"].startswith(e)
                ),
                10,
                "the rows' failure shown",
            )
            srcs = shown()
            assert srcs["rows-model"]["up"] and srcs["rows-model"]["buffers"] == []
            for good in (GOOD, DEMO):
                assert srcs[good]["buffers_error"] is None and srcs[good]["up"]
            assert srcs[DEMO]["buffers"]
            heads = rig.headlines()
            assert set(heads) == {GOOD, DEMO, "rows-model"} and heads[DEMO] < 1.0
            assert _error_counts(rig)["buffers"] >= before + 1
            assert "rows.json" not in rig.refused()  # served: its metrics are fine
            _canary_untouched(rig)
    finally:
        planted.unlink()


def test_thousands_of_files_do_not_slow_health_or_push_out_live_sources(rig):
    names = [f"flood{i:05d}.json" for i in range(3000)]
    for name in names:
        (rig.directory / name).write_bytes(b"{}\n[]")
    try:
        for _ in range(5):
            t0 = time.monotonic()
            assert rig.get("/healthz").status_code == 200
            assert time.monotonic() - t0 < 1.0
            t0 = time.monotonic()
            heads = rig.headlines()
            assert time.monotonic() - t0 < 3.0
            assert set(heads) == {GOOD, DEMO}
        problems = rig.debug()["files_not_served"]
        assert problems[0]["reason"] == "too_many_files"
        assert len(problems) <= 101  # bounded, whatever the directory holds
        text = rig.get("/metrics").text
        assert text.count("kvledger_snapshot_file_errors_total{") == 10  # one series per reason
        _canary_untouched(rig)
    finally:
        for name in names:
            os.unlink(rig.directory / name)


def _error_counts(rig: Rig) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(rig.get("/metrics").text):
        for s in fam.samples:
            if s.name == "kvledger_snapshot_file_errors_total":
                out[s.labels["reason"]] = s.value
    return out


def _canary_untouched(rig: Rig) -> None:
    st = os.stat(rig.canary)
    assert rig.canary.read_bytes() == b"the service user's own file\n"
    assert (st.st_mtime_ns, st.st_size, st.st_ino) == (
        rig.canary_stat.st_mtime_ns,
        rig.canary_stat.st_size,
        rig.canary_stat.st_ino,
    )


@pytest.mark.skipif(nobody_uid() is None, reason="needs root and a 'nobody' user")
@pytest.mark.parametrize("explicit", [True, False])
def test_a_directory_another_user_created_first_is_refused_at_start(explicit):
    """The predictable default (`<tmp>/kvledger-<uid>`) or an explicit --snapshot-dir,
    created first by another user with a link to a file of ours planted in it."""
    with shared_tmp() as tmp:
        d = tmp / f"kvledger-{os.geteuid()}"
        victim = tmp / "victim"
        victim.write_bytes(b"keep")
        as_nobody(
            f"import os; os.mkdir({str(d)!r}, 0o777); os.chmod({str(d)!r}, 0o777); "
            f"os.symlink({str(victim)!r}, {str(d / 'x.json')!r})"
        )
        args = ["--snapshot-dir", str(d)] if explicit else []
        env = {k: v for k, v in repo_env().items() if k != "XDG_RUNTIME_DIR"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvledger", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**env, "TMPDIR": str(tmp)},
            text=True,
        )
        try:
            _, err = proc.communicate(timeout=60)
        finally:
            stop(proc)
        assert proc.returncode == 2, err
        assert f"owned by uid {nobody_uid()}" in err and len(err.strip().splitlines()) == 1
        assert sorted(os.listdir(d)) == ["x.json"]
        assert victim.read_bytes() == b"keep"


def test_a_crashed_engine_is_down_until_its_restart_replaces_it(rig):
    """kill -9 leaves the file behind: the source is listed down (its alert fires) until a
    restart with the same engine labels publishes; then the dead one leaves /metrics and
    its file is removed at the next scan, not an hour later."""

    def engine() -> tuple[subprocess.Popen, str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.exporter.publisher_proc", str(rig.directory), "5", "0.2"],
            stdout=subprocess.PIPE,
            env=repo_env(),
            text=True,
        )
        assert proc.stdout is not None
        return proc, proc.stdout.readline().split()[1]

    def up() -> dict[str, bool]:
        return {s["source"]: s["up"] for s in rig.debug()["sources"]}

    first, name = engine()
    try:
        wait_until(lambda: up().get(name) is True, 20, "the engine is up")
        first.kill()
        first.wait()
        wait_until(lambda: up().get(name) is False, 10, "the crashed engine is down")
        assert (rig.directory / f"{name}.json").exists()
        second, name2 = engine()
        try:
            wait_until(lambda: up().get(name2) is True, 20, "the restart is up")
            t0 = time.monotonic()
            wait_until(lambda: name not in up(), 5, "the dead source is gone")
            assert time.monotonic() - t0 < 5
            assert not (rig.directory / f"{name}.json").exists()
            assert "mp-test" in rig.headlines()
        finally:
            stop(second)
    finally:
        stop(first)
    wait_until(lambda: name2 not in up(), 10, "a clean stop removes its own file")


# -- files that pass the schema but lie (a trusted writer: same user, root, the group) --------


def _lying(rig: Rig, name: str, change: Callable[[dict], None]) -> bytes:
    """The demo's file under `name` with its own engine labels, `change` applied to the
    first line's snapshot, and the totals summed again from the families (so only the
    relation `change` breaks can give it away)."""
    envelope, rows = _demo_file(rig)
    snap = json.loads(json.dumps(envelope["snapshot"]))
    snap["labels"] = {**snap["labels"], "model_name": name.removesuffix(".json")}
    change(snap)
    for figure in snap["totals"]:
        snap["totals"][figure] = sum(snap["families"][figure])
    envelope = {**envelope, "source": name.removesuffix(".json"), "snapshot": snap}
    return json.dumps(envelope).encode() + b"\n" + rows


def _huge(snap: dict) -> None:
    fam = snap["families"]  # the first line's columns
    for figure in ("reserved_bytes", "physical_bytes", "mapped_bytes"):
        fam[figure] = [1 << 59] * len(fam["family"])


def _occupied_without_slots(snap: dict) -> None:
    fam, acc = snap["families"], snap["accounts"]
    i = fam["owner"].index("vmm")
    for j, key in enumerate(zip(acc["family"], acc["owner"], strict=True)):
        if key == (fam["family"][i], "vmm"):
            acc["occupied_slots"][j] = 0
    fam["occupied_slots"][i] = 0
    fam["occupied_bytes"][i] = max(1, fam["mapped_bytes"][i] // 2)


def _partial_page(snap: dict) -> None:
    fam = snap["families"]
    fam["physical_bytes"][fam["owner"].index("vmm")] += 1


def _many_families(snap: dict) -> None:
    fam = snap["families"]
    more = 4096 - len(fam["family"])
    for name, column in fam.items():
        column += [f"lie{i}" for i in range(more)] if name == "family" else [column[0]] * more


LIES: dict[str, tuple[Callable[[dict], None], str]] = {
    "huge_headline": (_huge, "over the 1125899906842624 one source can hold"),
    "occupied_bytes_without_slots": (_occupied_without_slots, "(occupied_slots x slot_bytes)"),
    "partial_pages": (_partial_page, "not a whole number of pages"),
    "4096_families": (_many_families, "expected at most 64"),
}


@pytest.mark.parametrize("lie", list(LIES))
def test_a_first_line_that_lies_is_refused_with_the_reason(rig, lie):
    change, detail = LIES[lie]
    name = f"lie-{lie.replace('_', '-')}.json"
    before = rig.sequences()
    path = _plant(rig, name, _lying(rig, name, change))
    try:
        wait_until(lambda: rig.refused().get(name) == "schema", 10, f"{lie} refused")
        (problem,) = [p for p in rig.debug()["files_not_served"] if p["name"] == name]
        assert detail in problem["detail"], problem
        wait_until(
            lambda: all(rig.sequences().get(k, -1) > v for k, v in before.items()),
            10,
            "both good sources published again",
        )
        heads = rig.headlines()
        assert set(heads) == {GOOD, DEMO} and heads[DEMO] < 1.0
    finally:
        path.unlink()


def test_an_interval_is_believed_only_up_to_the_maximum(rig):
    """A file claiming a 3600 s interval, silent for 5 minutes, its pid on another host (so
    only the heartbeat can tell): down after 3 x 60 s + 1 s, not up for 3 hours."""
    name = "slow.json"
    envelope, rows = _demo_file(rig)
    snap = {**envelope["snapshot"], "labels": {"model_name": "slow-model", "tp_rank": "0"}}
    old = time.time() - 300
    data = json.dumps(
        {
            **envelope,
            "source": "slow",
            "host": "elsewhere",
            "interval": 3600.0,
            "published_at": old,
            "snapshot": {**snap, "taken_at": old},
        }
    ).encode()
    path = _plant(rig, name, data + b"\n" + rows)
    try:
        views = lambda: {s["source"]: s for s in rig.debug()["sources"]}  # noqa: E731
        wait_until(lambda: "slow" in views(), 10, "the slow file is read")
        slow = views()["slow"]
        assert not slow["up"] and "over the bound of 181.0 s" in slow["stale_reason"], slow
        assert slow["interval_seconds"] == 3600.0
        assert "slow-model" not in rig.headlines()
    finally:
        path.unlink()
