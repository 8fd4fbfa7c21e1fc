"""Inventory over duck-typed stand-ins for SGLang's pools (no sglang needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from accounting import Ledger
from kvledger.engines.sglang.inventory import inventory, pool_kind, register_pool


def _fake_dsv4() -> NS:
    ratios = [0, 4, 128, 4, 0]  # the trailing 0 stands for an MTP entry outside the stage
    swa = NS(page_size=256, kv_buffer=[torch.zeros(3, 1152, dtype=torch.uint8) for _ in range(4)])
    c4 = NS(page_size=64, kv_buffer=[torch.zeros(5, 576, dtype=torch.uint8) for _ in range(2)])
    c128 = NS(page_size=2, kv_buffer=[torch.zeros(7, 1728, dtype=torch.uint8)])
    idx = NS(
        page_size=64,
        index_k_with_scale_buffer=[torch.zeros(5, 64 * 132, dtype=torch.uint8) for _ in range(2)],
    )

    def state(ratio: int, rows: int, dim: int) -> NS:
        return NS(ratio=ratio, kv_score_buffer=NS(kv_score=torch.empty(rows, dim)))

    return NS(
        compression_ratios=ratios,
        _stage_start=0,
        _stage_end=4,
        swa_kv_pool=swa,
        kv_pools={4: c4, 128: c128},
        c4_kv_pool=c4,  # aliases, as in SGLang
        c128_kv_pool=c128,
        index_pools={4: idx},
        c4_indexer_kv_pool=idx,
        compress_state_pools=[
            None,
            state(4, 20, 2048),
            state(128, 256, 1024),
            state(4, 20, 2048),
            None,
        ],
        indexer_compress_state_pools=[None, state(4, 20, 512), None, state(4, 20, 512), None],
        mem_usage=0,
    )


def test_fake_dsv4_classified_and_counted_once() -> None:
    pool = _fake_dsv4()
    assert pool_kind(pool) == "dsv4"
    ledger = Ledger()
    inv = register_pool(ledger, pool, name="dsv4")
    by = {(s.family, s.layer) for s in inv.specs}
    assert by == {
        *(("swa_kv", i) for i in range(4)),
        ("c4_kv", 1),
        ("c4_kv", 3),
        ("c128_kv", 2),
        ("c4_indexer", 1),
        ("c4_indexer", 3),
        ("c4_attn_state", 1),
        ("c4_attn_state", 3),
        ("c128_state", 2),
        ("c4_indexer_state", 1),
        ("c4_indexer_state", 3),
    }
    snap = ledger.snapshot()
    assert not snap.violations
    expected = 4 * 3 * 1152 + 2 * 5 * 576 + 7 * 1728 + 2 * 5 * 8448 + 2 * 20 * 2048 * 4
    expected += 256 * 1024 * 4 + 2 * 20 * 512 * 4
    assert snap.total("physical_bytes") == snap.total("tensor_bytes") == expected
    assert inv.storage_bytes == expected
    # Paged families count entries, not pages.
    fam = snap.rollup("family")
    assert fam[("swa_kv",)]["capacity_slots"] == 3 * 256
    assert fam[("c128_kv",)]["capacity_slots"] == 7 * 2
    assert fam[("c4_attn_state",)]["capacity_slots"] == 20
    # Release: the accounts come out and the totals are back to zero.
    for acc in inv.accounts:
        ledger.remove_account(acc)
    assert ledger.snapshot().total("physical_bytes") == 0


def test_shared_storage_counted_once_kv_halves() -> None:
    layers = []
    for _ in range(2):
        both = torch.zeros(2, 40, 4, 8)
        layers.append((both[0], both[1]))
    pool = NS(k_buffer=[k for k, _ in layers], v_buffer=[v for _, v in layers], start_layer=5)
    inv = inventory(pool, name="mha")
    assert inv.kind == "mha"
    assert [(s.family, s.layer, s.shape) for s in inv.specs] == [
        ("kv", 5, (2, 40, 4, 8)),
        ("kv", 6, (2, 40, 4, 8)),
    ]
    assert all(s.tensor_bytes == s.reserved_bytes == 2 * 40 * 4 * 8 * 4 for s in inv.specs)


def test_separate_k_v_and_stray_tensor_as_other() -> None:
    pool = NS(
        k_buffer=[torch.zeros(8, 2)],
        v_buffer=[torch.zeros(8, 2)],
        k_data_ptrs=torch.zeros(1, dtype=torch.int64),
        nested={"deep": [torch.zeros(3)]},
    )
    inv = inventory(pool)
    fams = sorted(s.family for s in inv.specs)
    assert fams == ["k", "other", "other", "v"]
    assert inv.storage_bytes == 64 + 64 + 8 + 12


def test_swa_pool_maps_layers() -> None:
    full = NS(k_buffer=[torch.zeros(4, 1)], v_buffer=[torch.zeros(4, 1)], start_layer=0)
    swa = NS(
        k_buffer=[torch.zeros(2, 1), torch.zeros(2, 1)],
        v_buffer=[torch.zeros(2, 1), torch.zeros(2, 1)],
        start_layer=0,
    )
    pool = NS(
        full_kv_pool=full,
        swa_kv_pool=swa,
        layers_mapping={0: (0, True), 1: (0, False), 2: (1, True)},
    )
    inv = inventory(pool)
    assert inv.kind == "swa"
    got = sorted((s.family, s.layer) for s in inv.specs)
    assert got == [("k", 1), ("swa_k", 0), ("swa_k", 2), ("swa_v", 0), ("swa_v", 2), ("v", 1)]


def test_unknown_pool_refused() -> None:
    with pytest.raises(ValueError, match="pool of type dict: expected an SGLang KV pool"):
        inventory({})


def test_unknown_pool_reported_as_unknown_never_classified() -> None:
    # A hybrid-linear-like pool: neither a DSV4, SWA, MHA nor kv_buffer shape.
    conv = torch.zeros(4, 96)
    pool = NS(full_attention=NS(blocks=[torch.zeros(8, 32)]), mamba=NS(conv=[conv, conv[:2]]))
    with pytest.raises(ValueError, match="expected an SGLang KV pool"):
        inventory(pool, name="x")
    ledger = Ledger()
    inv = register_pool(ledger, pool, name="hyb", allow_unknown=True)
    assert inv.kind == "unknown" and set(inv.families()) == {"unknown"}
    assert inv.storage_bytes == 8 * 32 * 4 + 4 * 96 * 4  # the view of conv adds nothing
    snap = ledger.snapshot()
    assert snap.rollup("family")[("unknown",)]["physical_bytes"] == inv.storage_bytes
    with pytest.raises(ValueError, match="no tensor reachable"):
        inventory(NS(size=3), allow_unknown=True)


def test_register_pool_is_all_or_nothing() -> None:
    pool = NS(k_buffer=[torch.zeros(4, 8)], v_buffer=[torch.zeros(4, 8)])
    ledger = Ledger()
    register_pool(ledger, NS(k_buffer=[], v_buffer=[torch.zeros(2, 2)]), name="p")  # p/v
    with pytest.raises(ValueError, match="already registered"):
        register_pool(ledger, pool, name="p")  # p/k is added, then p/v clashes
    assert [a.key for a in ledger.accounts()] == ["p/v"]  # p/k was taken back


def test_accounting_does_not_import_sglang() -> None:
    code = "import accounting, kvledger.engines.sglang.inventory, kvledger.engines.sglang.dsv4, sys; print('sglang' in sys.modules)"
    root = Path(__file__).resolve().parents[4]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    assert out.stdout.strip() == "False"


def test_register_pool_leaves_out_the_excluded_families() -> None:
    """What the VMM bridge registers itself (swa_kv) is not registered twice as runtime-owned."""
    ledger = Ledger()
    inv = register_pool(ledger, _fake_dsv4(), name="dsv4", exclude=("swa_kv",))
    keys = {a.key for a in inv.accounts}
    assert "dsv4/swa_kv" not in keys and "dsv4/c4_kv" in keys
    assert {a.key for a in ledger.accounts()} == keys
