"""The plugin's pieces that need no SGLang: what the entry point imports, and one
process's RankLedger over duck-typed pools (main venv)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from accounting.snapfile.format import parse
from kvledger.engines.sglang.plugin import register
from kvledger.engines.sglang.plugin.rank import RankLedger
from kvledger.engines.sglang.plugin.snapdir import snapshot_dir
from tests.imports import ENTRY_POINT_OFF, imported_after

ROOT = Path(__file__).resolve().parents[5]


class NS(SimpleNamespace):
    """A duck-typed pool (weak-referenceable, as SGLang's pool classes are)."""


LABELS = {"model_name": "m", "engine_type": "unified", "tp_rank": "1", "pp_rank": "0"}


def _mha() -> NS:
    return NS(k_buffer=[torch.zeros(16, 8) for _ in range(2)], v_buffer=[torch.zeros(16, 8)])


def _runner(pool: NS, **kw) -> NS:
    return NS(token_to_kv_pool=pool, token_to_kv_pool_allocator=None, **kw)


def test_the_entry_point_off_imports_nothing_more() -> None:
    code = "import kvledger.engines.sglang.plugin as p; p.register()"
    packages = ("kvledger", "accounting", "allocator", "exporter", "torch", "sglang")
    assert imported_after(code, packages) == ENTRY_POINT_OFF


def test_register_off_in_this_process_registers_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVLEDGER_SGLANG", raising=False)
    monkeypatch.delitem(sys.modules, "kvledger.engines.sglang.plugin.server_hooks", raising=False)
    register()
    assert (
        "kvledger.engines.sglang.plugin.server_hooks" not in sys.modules
    )  # install() never reached


def test_snapshot_dir_from_the_environment_or_the_shared_default() -> None:
    from accounting.snapfile.directory import default_snapshot_dir

    assert snapshot_dir({"KVLEDGER_SNAPSHOT_DIR": "/x/y"}) == "/x/y"
    assert snapshot_dir({}) == default_snapshot_dir()


def test_rank_publishes_each_runner_pool_and_close_removes_everything(tmp_path: Path) -> None:
    rank = RankLedger(LABELS, directory=str(tmp_path), interval=60)
    mha = _mha()
    rec = rank.add_runner(_runner(mha))
    assert (rec.name, rec.kind, rec.device, rec.bridged) == ("mha", "mha", "cpu", False)
    assert rank.publisher is not None
    path = Path(rank.publisher.path)
    draft = rank.add_runner(
        _runner(NS(kv_buffer=[torch.zeros(4, 4)]), is_draft_worker=True, draft_model_idx=0)
    )
    assert draft.name == "draft0_kv"
    envelope, _ = parse(path.read_bytes())
    assert envelope["snapshot"]["labels"] == LABELS
    pools = set(envelope["snapshot"]["accounts"]["pool"])  # the first line's columns
    assert pools == {"mha", "draft0_kv"}
    assert envelope["snapshot"]["totals"]["physical_bytes"] == 3 * 16 * 8 * 4 + 4 * 4 * 4
    assert rank.pools["mha"].pool() is mha
    assert rank.add_runner(_runner(mha)) is rec  # the same pool again: nothing changes
    bigger = NS(k_buffer=[torch.zeros(32, 8)], v_buffer=[torch.zeros(32, 8)])
    rebuilt = rank.add_runner(_runner(bigger))  # the runner rebuilt its pool: replaced
    assert rebuilt is not rec and rank.pools["mha"] is rebuilt
    envelope, _ = parse(path.read_bytes())
    assert envelope["snapshot"]["totals"]["physical_bytes"] == 2 * 32 * 8 * 4 + 4 * 4 * 4
    rank.close()
    rank.close()  # idempotent
    assert not path.exists() and rank.ledger.accounts() == () and rank.pools == {}
    with pytest.raises(RuntimeError, match="closed"):
        rank.add_runner(_runner(_mha()))


def test_an_unknown_pool_is_reported_as_such(tmp_path: Path, caplog) -> None:
    pool = NS(layers=NS(conv=[torch.zeros(8, 8)], temporal=torch.zeros(2, 4)))
    with (
        RankLedger(LABELS, directory=str(tmp_path), interval=60) as rank,
        caplog.at_level(logging.WARNING),
    ):
        rec = rank.add_runner(_runner(pool))
        assert (rec.name, rec.kind) == ("unknown", "unknown")
        snap = rank.ledger.snapshot()
        assert set(k[0] for k in snap.rollup("family")) == {"unknown"}
        assert snap.total("physical_bytes") == 8 * 8 * 4 + 2 * 4 * 4
    assert "is not one the inventory knows" in caplog.text and "family 'unknown'" in caplog.text


def test_exit_close_keeps_the_pools_but_removes_the_file(tmp_path: Path) -> None:
    rank = RankLedger(LABELS, directory=str(tmp_path), interval=60)
    rank.add_runner(_runner(_mha()))
    assert rank.publisher is not None
    path = Path(rank.publisher.path)
    rank.close(release_pools=False)
    assert not path.exists() and len(rank.ledger.accounts()) == 2  # k and v


def test_no_nvml_truth_on_cpu_and_rebaseline_is_a_no_op(tmp_path: Path) -> None:
    with RankLedger(LABELS, directory=str(tmp_path), interval=60) as rank:
        rank.add_runner(_runner(_mha()))
        assert rank.truth is None and rank.rebaseline("after capture") is None
        assert rank.ledger.snapshot().reconciliation == ()
