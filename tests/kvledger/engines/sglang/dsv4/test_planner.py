"""The DeepSeek-V4 sizing model without SGLang: the Flash facts of docs/background.md#deepseek-v4-geometry and the planner."""

from __future__ import annotations

import pytest

from accounting import Ledger
from accounting.buffers import Owner
from allocator.slots.layout import SlotLayout
from kvledger.engines.sglang.dsv4 import FAMILIES, Knobs, plan
from kvledger.engines.sglang.dsv4 import geometry as g
from kvledger.engines.sglang.dsv4.buffermap import LOW_RATIO_FAMILIES
from tests.kvledger.engines.sglang.dsv4.fixtures import flash


def test_entry_and_page_bytes() -> None:
    assert g.kv_entry_bytes(448, 64) == 584
    assert g.kv_page_bytes(256, 584) == 149_760  # 149,504 B of entries padded to 260 x 576
    assert g.kv_page_bytes(256, 584) % 576 == 0
    assert g.kv_page_bytes(64, 584) == 37_440
    assert g.kv_page_bytes(2, 584) == 1_728  # c128: 2 rows, 1,168 B of entries
    assert g.indexer_entry_bytes(128, fp4=False) == 132
    assert g.indexer_entry_bytes(128, fp4=True) == 68
    assert g.state_last_dim(512, overlap=True) == 2048
    assert g.state_last_dim(128, overlap=True) == 512
    assert g.state_last_dim(512, overlap=False) == 1024
    assert (g.ring_size(4, False), g.ring_size(4, True)) == (8, 16)
    assert (g.ring_size(128, False), g.ring_size(128, True)) == (128, 256)
    assert g.physical_pages(2048, 256, 256) == 9  # one extra logical page
    assert g.state_rows(64, 8, 4) == 76  # 64 + 8 + 1 = 73 -> 76
    assert g.state_rows(9 * 128, 128, 128) == 1408  # 1152 + 129 = 1281 -> 11 x 128
    with pytest.raises(ValueError, match="ratio=0"):
        g.ring_size(0, False)


def test_flash_buffer_map_for_tokens() -> None:
    bm = plan(flash(), Knobs(max_running_requests=8), full_tokens=16_384)
    s = bm.sizes
    assert (s.full_tokens, s.swa_tokens, s.c4_tokens, s.c128_tokens) == (16_384, 1_536, 4_096, 128)
    assert (s.c4_state_size, s.c128_state_size, s.num_req_slots) == (6 * 8, 9 * 128, 9)
    counts = {f: len(bm.family_buffers(f)) for f in FAMILIES}
    assert counts == {
        "swa_kv": 43,
        "c4_kv": 21,
        "c128_kv": 20,
        "c4_indexer": 21,
        "c4_attn_state": 21,
        "c4_indexer_state": 21,
        "c128_state": 20,
    }
    swa = bm.family_buffers("swa_kv")[0]
    assert swa.shape == ((1_536 + 256) // 256, 149_760) and swa.dtype == "uint8"
    assert (swa.slot_bytes, swa.slots_per_row, swa.row_bytes) == (584, 256, 149_760)
    c4 = bm.family_buffers("c4_kv")[0]
    assert c4.shape == ((4_096 + 256) // 64, 37_440) and c4.layer == 2
    c128 = bm.family_buffers("c128_kv")[0]
    assert c128.shape == ((128 + 256) // 2, 1_728) and c128.layer == 3
    idx = bm.family_buffers("c4_indexer")[0]
    assert idx.shape == ((128 * 32 + 256) // 64, 64 * 132) and idx.slot_bytes == 132
    att = bm.family_buffers("c4_attn_state")[0]
    assert att.shape == (g.ceil_div(48 + 8 + 1, 4) * 4, 2048) and att.dtype == "float32"
    ist = bm.family_buffers("c4_indexer_state")[0]
    assert ist.shape == (att.shape[0], 512)
    st = bm.family_buffers("c128_state")[0]
    assert st.shape == (g.ceil_div(9 * 128 + 128 + 1, 128) * 128, 1024)
    assert st.tensor_bytes == st.shape[0] * 1024 * 4
    assert bm.total_allocated_bytes == sum(b.tensor_bytes for b in bm.buffers)
    assert all(b.tensor_bytes == b.shape[0] * b.shape[1] * b.element_size for b in bm.buffers)


def test_state_dtype_halves_state_bytes_only() -> None:
    shape, kw = flash(), {"full_tokens": 65_536}
    a = plan(shape, Knobs(max_running_requests=8), **kw)
    b = plan(shape, Knobs(max_running_requests=8, state_dtype="bf16"), **kw)
    for fam in FAMILIES:
        ratio = 2 if fam.endswith("_state") else 1
        assert a.allocated_bytes(fam) == ratio * b.allocated_bytes(fam), fam
    assert b.family_buffers("c128_state")[0].dtype == "bfloat16"
    assert Knobs(state_dtype="bfloat16").state_dtype == "bf16"


def test_fp4_indexer_is_priced_as_fp8() -> None:
    bm = plan(flash(), Knobs(max_running_requests=8, indexer_dtype="fp4"), full_tokens=65_536)
    fam = bm.families["c4_indexer"]
    assert fam.slot_bytes == 68
    assert fam.planned_bytes == 65_536 // 4 * 132 * 21
    assert fam.allocated_bytes < fam.planned_bytes  # overhead is negative
    assert any("fp4" in r for r in fam.reasons)


def test_speculative_rings_and_inflation() -> None:
    plain = plan(flash(), Knobs(max_running_requests=8), full_tokens=65_536)
    spec = plan(
        flash(), Knobs(max_running_requests=8, speculative_draft_tokens=4), full_tokens=65_536
    )
    assert spec.sizes.c4_state_size == 2 * plain.sizes.c4_state_size  # ring 16 per SWA page
    assert spec.sizes.c128_state_size == 9 * 256
    assert spec.pricing.spec_inflation == pytest.approx(44 / 43)
    coeff = sum(spec.pricing.family_bytes_per_full_token.values())
    assert spec.pricing.bytes_per_full_token == pytest.approx(coeff * 44 / 43)
    assert sum(plain.pricing.family_bytes_per_full_token.values()) == pytest.approx(
        plain.pricing.bytes_per_full_token
    )
    assert spec.draft_reserve_bytes > 0 and plain.draft_reserve_bytes == 0
    with pytest.raises(ValueError, match="speculative_draft_tokens=11, expected at most 10"):
        plan(flash(), Knobs(speculative_draft_tokens=11), full_tokens=65_536)


def test_flash_pricing() -> None:
    p = plan(flash(), Knobs(max_running_requests=8), full_tokens=65_536).pricing
    assert p.kv_bytes_per_entry == {0: 585.0, 4: 585.0, 128: 864.0}
    # 585 x 43 + 8/256 x (8192 + 2048) x 21 = 25,155 + 6,720
    assert p.bytes_per_swa_token == 31_875.0
    # 0.1 x 31,875 + 21 x (585 + 132) / 4 + 20 x 864 / 128
    assert p.bytes_per_full_token == pytest.approx(7_086.75)


def test_budget_plan_matches_budget_roughly_and_planner_sums() -> None:
    budget = 8 << 30
    bm = plan(flash(), Knobs(max_running_requests=64), budget_bytes=budget)
    assert bm.sizes.full_tokens % 256 == 0
    # The planner spends at most the budget on what it prices ...
    assert bm.total_planned_bytes <= budget
    # ... and one more page of full tokens would not fit.
    more = (bm.sizes.full_tokens + 256) * bm.pricing.bytes_per_full_token + bm.fixed_bytes
    assert more > budget
    planned = sum(bm.planned_bytes(f) for f in FAMILIES)
    assert planned == bm.total_planned_bytes
    assert planned == pytest.approx(
        bm.sizes.full_tokens * bm.pricing.bytes_per_full_token + bm.fixed_bytes, abs=8
    )
    # Allocation differs from the plan by page padding and extra pages, per family.
    for fam in ("swa_kv", "c4_kv", "c128_kv", "c4_indexer", "c4_attn_state"):
        assert bm.families[fam].overhead_bytes > 0, fam
    # The c128 state is planned as fixed bytes with its rows already rounded.
    assert bm.families["c128_state"].overhead_bytes == 0


def test_budget_without_request_cap_uses_sglang_estimate() -> None:
    bm = plan(flash(), Knobs(), budget_bytes=80 << 30)
    assert bm.planning_max_running_requests == 4096
    assert bm.sizes.max_running_requests == 4096
    # 4097 request slots x 128-row rings, fp32 1024-wide rows, 20 layers
    rows = g.ceil_div(4097 * 128 + 129, 128) * 128
    assert bm.planned_bytes("c128_state") == rows * 1024 * 4 * 20


def test_budget_errors() -> None:
    with pytest.raises(ValueError, match="budget_bytes=1000 is too small for one page per buffer"):
        plan(flash(), Knobs(max_running_requests=4), budget_bytes=1000)
    with pytest.raises(ValueError, match="expected exactly one"):
        plan(flash(), Knobs(), full_tokens=1, budget_bytes=1)
    with pytest.raises(ValueError, match="expected exactly one"):
        plan(flash(), Knobs())
    with pytest.raises(ValueError, match="full_tokens=-5, expected a positive integer"):
        plan(flash(), Knobs(), full_tokens=-5)
    with pytest.raises(ValueError, match="full_tokens=1000 gives 0 SWA tokens"):
        plan(flash(), Knobs(), full_tokens=1000)


def test_smallest_budget_is_accepted() -> None:
    from kvledger.engines.sglang.dsv4 import planner

    shape, knobs = flash(), Knobs(max_running_requests=4)
    need = planner.min_budget_bytes(shape, knobs, planner.pricing(shape, knobs))
    bm = plan(shape, knobs, budget_bytes=need)
    assert bm.sizes.swa_tokens > shape.sliding_window + 256
    with pytest.raises(ValueError, match=f"at least {need} bytes"):
        plan(shape, knobs, budget_bytes=need - 1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"state_dtype": "fp16"}, "state_dtype='fp16', expected one of fp32, bf16"),
        ({"indexer_dtype": "int8"}, "indexer_dtype='int8', expected one of fp8, fp4"),
        ({"page_size": 100}, "page_size=100, expected an integer >= 128"),
        ({"page_size": 384 + 64}, "page_size=448, expected a multiple of 128"),
        ({"speculative_draft_tokens": -1}, "speculative_draft_tokens=-1"),
        ({"max_running_requests": 0}, "max_running_requests=0"),
        ({"swa_full_tokens_ratio": 0}, "swa_full_tokens_ratio=0"),
        ({"swa_full_tokens_ratio": 1.5}, "swa_full_tokens_ratio=1.5"),
    ],
)
def test_knob_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Knobs(**kwargs)  # type: ignore[arg-type]


def test_swa_only_and_mtp_entry_ignored() -> None:
    shape = flash().with_ratios([0, 0, 0])
    bm = plan(shape, Knobs(max_running_requests=2), full_tokens=8192)
    assert [b.family for b in bm.buffers] == ["swa_kv"] * 3
    assert bm.families["c128_state"].planned_bytes == 0
    assert bm.families["c4_kv"].allocated_bytes == 0
    # The Flash config's 44th ratio (its MTP layer) owns no buffer.
    full = plan(flash(), Knobs(max_running_requests=2), full_tokens=8192)
    assert max(b.layer for b in full.buffers) == 42


def test_swa_layout_builds_allocator_slot_layout() -> None:
    bm = plan(flash(), Knobs(max_running_requests=8), full_tokens=65_536)
    b = bm.family_buffers("swa_kv")[0]
    layout = SlotLayout(
        capacity_slots=b.capacity_slots,
        slot_bytes=b.slot_bytes,
        page_bytes=2 << 20,
        slots_per_row=b.slots_per_row,
        row_bytes=b.row_bytes,
    )
    assert layout.buffer_bytes == b.tensor_bytes


def test_specs_register_into_ledger() -> None:
    bm = plan(flash(), Knobs(max_running_requests=8), full_tokens=65_536)
    specs = bm.specs(pool="dsv4", owner_of={"swa_kv": Owner.VMM})
    assert len(specs) == len(bm.buffers)
    ledger = Ledger()
    for fam in FAMILIES:
        fs = [s for s in specs if s.family == fam]
        if fam == "swa_kv":
            assert all(s.owner is Owner.VMM and s.reserved_bytes % (2 << 20) == 0 for s in fs)
            ledger.add_account(fs, page_bytes=2 << 20)
        else:
            assert all(s.reserved_bytes == s.tensor_bytes for s in fs)
            ledger.add_account(fs)
    snap = ledger.snapshot()
    assert not snap.violations
    rollup = snap.rollup("family")
    for fam in FAMILIES:
        assert rollup[(fam,)]["tensor_bytes"] == bm.allocated_bytes(fam)
        assert rollup[(fam,)]["capacity_slots"] == bm.families[fam].capacity_slots
    # Runtime families hold their storage; the VMM family holds nothing until pages map.
    assert rollup[("swa_kv",)]["physical_bytes"] == 0
    assert rollup[("c4_kv",)]["physical_bytes"] == bm.allocated_bytes("c4_kv")
    with pytest.raises(ValueError, match=r"expected an accounting\.buffers\.Owner"):
        bm.specs(owner_of=lambda f: "vmm")  # type: ignore[arg-type,return-value]


def test_swa_cap_mode() -> None:
    knobs = Knobs(max_running_requests=256, swa_sizing="cap", chunked_prefill_size=8192)
    bm = plan(flash(), knobs, budget_bytes=80 << 30)
    # per request 128 + 128 + 256 + 256 = 768; 768 x 256 + 2 x 8192 + 256 = 213,248;
    # 4 x 256 prefix tails x (128 + 256) = 393,216; 606,464 is whole pages.
    assert bm.pricing.swa_cap_tokens == 606_464
    assert bm.sizes.swa_tokens == 606_464
    assert bm.sizes.c4_state_size == 606_464 // 256 * 8
    # The SWA term leaves the per-token coefficient and becomes fixed bytes.
    assert bm.pricing.bytes_per_full_token == pytest.approx(21 * (585 + 132) / 4 + 20 * 864 / 128)
    assert bm.fixed_bytes == bm.planned_bytes("c128_state") + 606_464 * 31_875
    assert bm.total_planned_bytes <= 80 << 30
    assert bm.planned_bytes("swa_kv") == 606_464 * 585 * 43
    no_radix = plan(flash(), knobs.replace(disable_radix_cache=True), budget_bytes=80 << 30)
    assert no_radix.sizes.swa_tokens == g.ceil_div(213_248, 256) * 256
    tails = plan(
        flash(),
        knobs.replace(swa_prefix_tails=1, disable_overlap_schedule=True),
        full_tokens=1 << 20,
    )
    assert tails.sizes.swa_tokens == g.ceil_div(768 * 256 + 8192 + 256 + 384, 256) * 256


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"swa_sizing": "fixed"}, "swa_sizing='fixed', expected one of ratio, cap"),
        ({"swa_sizing": "cap", "chunked_prefill_size": 8192}, "expected both set"),
        ({"swa_sizing": "cap", "max_running_requests": 8}, "expected both set"),
        (
            {
                "swa_sizing": "cap",
                "max_running_requests": 8,
                "chunked_prefill_size": 8,
                "speculative_draft_tokens": 2,
            },
            "cap mode with speculative decoding is not modelled",
        ),
        ({"chunked_prefill_size": 0}, "chunked_prefill_size=0"),
        ({"swa_eviction_interval": 0}, "swa_eviction_interval=0"),
    ],
)
def test_cap_knob_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Knobs(**kwargs)  # type: ignore[arg-type]


def test_cap_budget_too_small_names_the_cap() -> None:
    knobs = Knobs(max_running_requests=4096, swa_sizing="cap", chunked_prefill_size=8192)
    with pytest.raises(ValueError, match="-token SWA cap"):
        plan(flash(), knobs, budget_bytes=8 << 30)


# -- DeepSeek-V4.1 ------------------------------------------------------------------------------
def test_v41_layouts_and_pricing() -> None:
    """V4.1 by default (auto, as SGLang on SM100): 528-byte fp8 entries for SWA, c4 and c128
    (c128's two-entry page padded to 3 x 512), fp4 288-byte entries for ratios 1 and 2."""
    from tests.kvledger.engines.sglang.dsv4.fixtures import v41

    bm = plan(v41(), Knobs(max_running_requests=8), full_tokens=16384)
    assert bm.kv_layout == "v41"
    assert bm.pricing.kv_layouts == {0: "v41", 1: "v41_fp4", 2: "v41_fp4", 4: "v41", 128: "v41"}
    assert bm.pricing.kv_bytes_per_entry == {0: 528.0, 4: 528.0, 128: 768.0, 1: 288.0, 2: 288.0}
    assert tuple(bm.families) == FAMILIES + LOW_RATIO_FAMILIES
    fam = bm.families
    assert fam["swa_kv"].shape == (1638 // 256 + 1, 256 * 528)
    assert fam["swa_kv"].slot_bytes == 528
    assert fam["c1_kv"].layers == (2, 8, 14, 20, 26, 32, 38)
    # 16384 / 1 slots in 256-slot pages plus the reserved logical page: 65 pages of 73,728 B.
    assert fam["c1_kv"].shape == (65, 256 * 288)
    assert fam["c2_kv"].shape == (66, 128 * 288)
    # The fp4 indexer: (16384 + 256) / r slots in 64-slot pages, one more page reserved.
    assert fam["c1_indexer"].shape == (261, 64 * 68)
    assert fam["c2_indexer"].shape == (131, 64 * 68)
    # Pair state: 9 slots x 2-row rings + 3, rounded to 2; fp32 (kv, score) of 512 each.
    assert fam["c2_state"].shape == (22, 1024) and fam["c2_state"].dtype == "float32"
    assert fam["c2_state"].planned_bytes == 22 * 1024 * 4 * 7
    # The fp8 option keeps the low ratios in fp8 too; v41_new pads each page to one token.
    fp8 = plan(v41(), Knobs(max_running_requests=8, compressed_kv_layout="fp8"), full_tokens=16384)
    assert fp8.families["c1_kv"].shape == (65, 256 * 528)
    new = plan(v41(), Knobs(max_running_requests=8, kv_layout="v41_new"), full_tokens=16384)
    assert new.pricing.kv_bytes_per_entry[128] == 528.0
    assert new.families["c1_kv"].slot_bytes == 288
    # Forced V4 keeps 584-byte entries, the low ratios included.
    v4 = plan(v41(), Knobs(max_running_requests=8, kv_layout="v4"), full_tokens=16384)
    assert v4.pricing.kv_layouts[1] == "v4" and v4.families["c1_kv"].slot_bytes == 584


def test_v41_budget_leaves_room_for_the_reserved_low_ratio_pages() -> None:
    from kvledger.engines.sglang.dsv4 import planner
    from tests.kvledger.engines.sglang.dsv4.fixtures import v41

    shape, knobs = v41(), Knobs(max_running_requests=64)
    bm = plan(shape, knobs, budget_bytes=80 << 30)
    full = bm.sizes.full_tokens
    pad = planner.low_ratio_padding_bytes(shape, knobs, bm.pricing, full)
    assert pad > 0
    assert full * bm.pricing.bytes_per_full_token + pad + bm.fixed_bytes <= 80 << 30
    assert bm.families["c2_state"].planned_bytes > 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kv_layout": "v5"}, "kv_layout='v5', expected one of auto, v4, v41, v41_new"),
        ({"compressed_kv_layout": "int4"}, "compressed_kv_layout='int4', expected one of"),
        ({"kv_layout": "v4", "compressed_kv_layout": "fp4"}, "pairs only with V4 caches"),
        ({"low_ratio_index_page": 96}, "low_ratio_index_page=96, expected 64 or 128"),
    ],
)
def test_v41_knob_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Knobs(**kwargs)  # type: ignore[arg-type]
