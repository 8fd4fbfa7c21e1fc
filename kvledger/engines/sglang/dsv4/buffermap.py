"""The DeepSeek-V4 buffer map: every buffer of the seven V4 families (and the five V4.1
low-ratio ones where the config has ratio-1/2 layers), and plan vs allocation.

`plan()` sizes the pools as SGLang 0.5.23 does (kvledger.engines.sglang.dsv4.planner) and
lays out each buffer as `DeepSeekV4TokenToKVPool` allocates it
(kvledger.engines.sglang.dsv4.geometry). Per family it sets the planner's predicted bytes
beside the real allocation; they part over page padding (a 256-token page of
584-byte V4 entries is padded to 576-byte multiples), the extra logical page every
paged sub-pool reserves, the low-ratio indexer slots past full / ratio, state rows
rounded up to the ratio, the fp4 indexer priced as fp8, and request counts that
differ between planning and building.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from accounting.buffers import BufferSpec, Owner
from allocator.backend import DEFAULT_GRANULARITY
from kvledger.engines.sglang.dsv4 import geometry as g
from kvledger.engines.sglang.dsv4 import planner
from kvledger.engines.sglang.dsv4.knobs import Knobs
from kvledger.engines.sglang.dsv4.shape import Dsv4Shape

FAMILIES: tuple[str, ...] = (
    "swa_kv",
    "c4_kv",
    "c128_kv",
    "c4_indexer",
    "c4_attn_state",
    "c4_indexer_state",
    "c128_state",
)
# DeepSeek-V4.1's low-ratio layers (compress ratios 1 and 2): only their kv_source layers own
# a compressed cache and an fp4 indexer cache; ratio-2 sources keep a pending-pair state ring.
LOW_RATIO_FAMILIES: tuple[str, ...] = ("c1_kv", "c1_indexer", "c2_kv", "c2_indexer", "c2_state")
ALL_FAMILIES: tuple[str, ...] = FAMILIES + LOW_RATIO_FAMILIES

# What one slot of each family is, for tables and docs.
SLOT_MEANING: dict[str, str] = {
    "swa_kv": "token",
    "c4_kv": "compressed row (4 tokens)",
    "c128_kv": "compressed row (128 tokens)",
    "c4_indexer": "compressed row (4 tokens)",
    "c4_attn_state": "ring row",
    "c4_indexer_state": "ring row",
    "c128_state": "ring row",
    "c1_kv": "compressed row (1 token)",
    "c1_indexer": "compressed row (1 token)",
    "c2_kv": "compressed row (2 tokens)",
    "c2_indexer": "compressed row (2 tokens)",
    "c2_state": "pair ring row",
}


@dataclass(frozen=True)
class Dsv4Buffer:
    """One tensor of the pool, as SGLang 0.5.23 allocates it."""

    name: str
    family: str
    layer: int
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch."
    element_size: int
    slot_bytes: int  # bytes of one entry / row
    capacity_slots: int  # slots the tensor holds, reserved page included
    slots_per_row: int  # entries per tensor row (a page for paged families)
    row_bytes: int  # bytes per tensor row (the padded page for paged families)

    @property
    def tensor_bytes(self) -> int:
        n = self.element_size
        for d in self.shape:
            n *= d
        return n

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "family": self.family,
            "layer": self.layer,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "tensor_bytes": self.tensor_bytes,
            "slot_bytes": self.slot_bytes,
            "capacity_slots": self.capacity_slots,
            "slots_per_row": self.slots_per_row,
            "row_bytes": self.row_bytes,
        }


@dataclass(frozen=True)
class FamilyPlan:
    """Planned next to allocated bytes of one family, summed over its layers."""

    family: str
    layers: tuple[int, ...]
    planned_bytes: int  # what SGLang's planner priced this family at
    allocated_bytes: int  # tensor bytes of the buffers really allocated
    usable_slots: int  # slots the allocator hands out (per layer buffer)
    capacity_slots: int  # slots the tensors hold (per layer buffer)
    slot_bytes: int
    shape: tuple[int, ...]  # of one layer's buffer
    dtype: str
    reasons: tuple[str, ...] = ()

    @property
    def overhead_bytes(self) -> int:
        return self.allocated_bytes - self.planned_bytes

    @property
    def overhead_pct(self) -> float | None:
        if self.planned_bytes == 0:
            return None
        return 100.0 * self.overhead_bytes / self.planned_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "buffers": len(self.layers),
            "layers": list(self.layers),
            "shape": list(self.shape),
            "dtype": self.dtype,
            "slot_bytes": self.slot_bytes,
            "usable_slots": self.usable_slots,
            "capacity_slots": self.capacity_slots,
            "planned_bytes": self.planned_bytes,
            "allocated_bytes": self.allocated_bytes,
            "overhead_bytes": self.overhead_bytes,
            "overhead_pct": self.overhead_pct,
            "reasons": list(self.reasons),
        }


@dataclass(frozen=True)
class BufferMap:
    shape: Dsv4Shape
    knobs: Knobs
    sizes: planner.PoolSizes
    pricing: planner.Pricing
    buffers: tuple[Dsv4Buffer, ...]
    families: dict[str, FamilyPlan]  # every family of FAMILIES, then the low-ratio ones present
    budget_bytes: int | None = None
    planning_max_running_requests: int | None = None
    fixed_bytes: int = 0  # outside the per-token coefficient: c128 and c2 state, SWA cap
    _by_family: dict[str, tuple[Dsv4Buffer, ...]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def family_buffers(self, family: str) -> tuple[Dsv4Buffer, ...]:
        if family not in self.families:
            raise KeyError(f"unknown family {family!r}, expected one of {', '.join(self.families)}")
        if not self._by_family:
            for f in self.families:
                self._by_family[f] = tuple(b for b in self.buffers if b.family == f)
        return self._by_family[family]

    @property
    def kv_layout(self) -> str:
        """The SWA (main) cache's KV layout: v4, v41 or v41_new."""
        return self.pricing.kv_layouts[0]

    def planned_bytes(self, family: str) -> int:
        return self.families[family].planned_bytes

    def allocated_bytes(self, family: str) -> int:
        return self.families[family].allocated_bytes

    @property
    def total_planned_bytes(self) -> int:
        return sum(f.planned_bytes for f in self.families.values())

    @property
    def total_allocated_bytes(self) -> int:
        return sum(b.tensor_bytes for b in self.buffers)

    @property
    def draft_reserve_bytes(self) -> int:
        """Bytes the planner set aside for the speculative draft worker's own pool
        (the (L+1)/L inflation); not a buffer of this pool."""
        base = self.pricing.bytes_per_full_token / self.pricing.spec_inflation
        return round(self.sizes.full_tokens * (self.pricing.bytes_per_full_token - base))

    def specs(
        self,
        *,
        pool: str = "dsv4",
        owner_of: Callable[[str], Owner] | Mapping[str, Owner] | None = None,
        granularity: int = DEFAULT_GRANULARITY,
    ) -> list[BufferSpec]:
        """BufferSpecs to register into a Ledger, one per buffer.

        `owner_of` maps a family to its owner (default: all runtime-owned, SGLang's
        own allocation). A VMM-owned buffer reserves its tensor bytes rounded up to
        `granularity`; a runtime-owned one reserves exactly its tensor bytes.
        """
        if isinstance(granularity, bool) or not isinstance(granularity, int) or granularity <= 0:
            raise ValueError(f"granularity={granularity!r}, expected a positive int")
        specs = []
        for b in self.buffers:
            owner = _owner(owner_of, b.family)
            reserved = b.tensor_bytes
            if owner is Owner.VMM:
                reserved = g.ceil_div(b.tensor_bytes, granularity) * granularity
            specs.append(
                BufferSpec(
                    name=b.name,
                    family=b.family,
                    pool=pool,
                    owner=owner,
                    layer=b.layer,
                    dtype=b.dtype,
                    shape=b.shape,
                    slot_bytes=b.slot_bytes,
                    capacity_slots=b.capacity_slots,
                    tensor_bytes=b.tensor_bytes,
                    reserved_bytes=reserved,
                )
            )
        return specs

    def to_dict(self) -> dict[str, Any]:
        s = self.sizes
        return {
            "reference": "sglang==0.5.23",
            "config": self.shape.source,
            "knobs": {
                "page_size": self.knobs.page_size,
                "state_dtype": self.knobs.state_dtype,
                "indexer_dtype": self.knobs.indexer_dtype,
                "speculative_draft_tokens": self.knobs.speculative_draft_tokens,
                "max_running_requests": self.knobs.max_running_requests,
                "swa_full_tokens_ratio": self.knobs.swa_full_tokens_ratio,
                "swa_sizing": self.knobs.swa_sizing,
                "chunked_prefill_size": self.knobs.chunked_prefill_size,
                "context_length": planner.context_length(self.shape, self.knobs),
                "kv_layout": self.kv_layout,
                "compressed_kv_layout": self.knobs.compressed_kv_layout,
            },
            "kv_layouts": {
                ("swa" if r == 0 else f"c{r}"): lay
                for r, lay in self.pricing.kv_layouts.items()
                if r == 0 or self.shape.owner_layers(r)
            },
            "kv_source_layer_ids": list(self.shape.kv_source_layer_ids),
            "sizes": {
                "full_tokens": s.full_tokens,
                "swa_tokens": s.swa_tokens,
                "c4_tokens": s.c4_tokens,
                "c4_indexer_tokens": s.c4_indexer_tokens,
                "c128_tokens": s.c128_tokens,
                "c4_state_size": s.c4_state_size,
                "c128_state_size": s.c128_state_size,
                "max_running_requests": s.max_running_requests,
                "num_req_slots": s.num_req_slots,
            },
            "planner": {
                "budget_bytes": self.budget_bytes,
                "bytes_per_full_token": self.pricing.bytes_per_full_token,
                "bytes_per_swa_token": self.pricing.bytes_per_swa_token,
                "spec_inflation": self.pricing.spec_inflation,
                "fixed_bytes": self.fixed_bytes,
                "swa_cap_tokens": self.pricing.swa_cap_tokens,
                "planning_max_running_requests": self.planning_max_running_requests,
                "draft_reserve_bytes": self.draft_reserve_bytes,
            },
            "totals": {
                "planned_bytes": self.total_planned_bytes,
                "allocated_bytes": self.total_allocated_bytes,
            },
            "families": {f: p.to_dict() for f, p in self.families.items()},
            "buffers": [b.to_dict() for b in self.buffers],
        }


def _owner(owner_of: Callable[[str], Owner] | Mapping[str, Owner] | None, family: str) -> Owner:
    if owner_of is None:
        return Owner.RUNTIME
    owner = (
        owner_of.get(family, Owner.RUNTIME) if isinstance(owner_of, Mapping) else owner_of(family)
    )
    if not isinstance(owner, Owner):
        raise ValueError(f"owner_of({family!r}) = {owner!r}, expected an accounting.buffers.Owner")
    return owner


def plan(
    shape: Dsv4Shape,
    knobs: Knobs | None = None,
    *,
    full_tokens: int | None = None,
    budget_bytes: int | None = None,
) -> BufferMap:
    """The buffer map for `full_tokens` full-pool tokens, or for a byte budget sized the way
    SGLang 0.5.23's DSV4PoolConfigurator sizes it. Exactly one of the two is given."""
    knobs = knobs or Knobs()
    if not isinstance(shape, Dsv4Shape):
        raise ValueError(
            f"shape={shape!r}, expected a Dsv4Shape (kvledger.engines.sglang.dsv4.load_config)"
        )
    if (full_tokens is None) == (budget_bytes is None):
        raise ValueError(
            f"full_tokens={full_tokens!r}, budget_bytes={budget_bytes!r}: expected exactly one"
        )
    for name, value in (("full_tokens", full_tokens), ("budget_bytes", budget_bytes)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value <= 0
        ):
            raise ValueError(f"{name}={value!r}, expected a positive integer")
    _check_draft_tokens(shape, knobs)
    price = planner.pricing(shape, knobs)
    planning_mrr: int | None = None
    if budget_bytes is not None:
        solution = planner.solve_budget(shape, knobs, price, budget_bytes)
        sizes = planner.sizes_for_full_tokens(shape, knobs, solution.full_tokens)
        planning_mrr = solution.planning_max_running_requests
        c128_fixed = solution.c128_state_fixed_bytes
        c2_fixed = solution.c2_state_fixed_bytes
    else:
        assert full_tokens is not None
        sizes = planner.sizes_for_full_tokens(shape, knobs, full_tokens)
        c128_fixed = planner.c128_state_fixed_bytes(shape, knobs, sizes.max_running_requests)
        c2_fixed = planner.c2_state_fixed_bytes(shape, knobs, sizes.max_running_requests)
    swa_fixed = (price.swa_cap_tokens or 0) * price.bytes_per_swa_token
    fixed = round(c128_fixed + c2_fixed + swa_fixed)
    buffers = _buffers(shape, knobs, sizes, price)
    fixed_by_family = {"c128_state": c128_fixed, "c2_state": c2_fixed}
    families = _families(shape, knobs, sizes, price, buffers, fixed_by_family, planning_mrr)
    return BufferMap(
        shape=shape,
        knobs=knobs,
        sizes=sizes,
        pricing=price,
        buffers=buffers,
        families=families,
        budget_bytes=budget_bytes,
        planning_max_running_requests=planning_mrr,
        fixed_bytes=fixed,
    )


def _check_draft_tokens(shape: Dsv4Shape, knobs: Knobs) -> None:
    """DSV4PoolConfigurator._assert_ring_serves_draft_tokens."""
    if not knobs.speculative:
        return
    for ratio in (4, 128):
        if not shape.layers(ratio):
            continue
        limit = g.max_draft_tokens(ratio, g.ring_size(ratio, True))
        if knobs.speculative_draft_tokens > limit:
            raise ValueError(
                f"speculative_draft_tokens={knobs.speculative_draft_tokens}, expected at most "
                f"{limit}: the c{ratio} compress-state ring of SGLang 0.5.23 serves no more"
            )


def _per_layer(
    family: str,
    layers: tuple[int, ...],
    *,
    rows: int,
    row_elements: int,
    dtype: str,
    element_size: int,
    slot_bytes: int,
    slots_per_row: int,
) -> list[Dsv4Buffer]:
    """One `rows x row_elements` tensor of `dtype` per layer of `family`, each row holding
    `slots_per_row` slots of `slot_bytes`."""
    return [
        Dsv4Buffer(
            name=f"{family}.L{layer}",
            family=family,
            layer=layer,
            shape=(rows, row_elements),
            dtype=dtype,
            element_size=element_size,
            slot_bytes=slot_bytes,
            capacity_slots=rows * slots_per_row,
            slots_per_row=slots_per_row,
            row_bytes=row_elements * element_size,
        )
        for layer in layers
    ]


def _buffers(
    shape: Dsv4Shape, knobs: Knobs, sizes: planner.PoolSizes, price: planner.Pricing
) -> tuple[Dsv4Buffer, ...]:
    p = knobs.page_size
    layouts = price.kv_layouts
    out: list[Dsv4Buffer] = []

    def paged(
        family: str,
        layers: tuple[int, ...],
        size: int,
        per_page: int,
        slot: int,
        row: int,
        reserved: int = p,
    ) -> None:
        """A page of `per_page` slots per uint8 row of `row` bytes (the padded page), with
        `reserved` tokens (a logical page) held back beyond `size`."""
        pages = g.physical_pages(size, per_page, reserved)
        out.extend(
            _per_layer(
                family,
                layers,
                rows=pages,
                row_elements=row,
                dtype="uint8",
                element_size=1,
                slot_bytes=slot,
                slots_per_row=per_page,
            )
        )

    def kv(family: str, layers: tuple[int, ...], size: int, ratio: int) -> None:
        lay = layouts[ratio]
        entry = planner.entry_bytes(shape, lay)
        per_page = p // ratio if ratio else p
        paged(family, layers, size, per_page, entry, g.layout_page_bytes(lay, per_page, entry))

    def state(
        family: str,
        layers: tuple[int, ...],
        rows: int,
        last: int,
        dtype: str,
        element_size: int,
    ) -> None:
        """One compress-state entry per row."""
        out.extend(
            _per_layer(
                family,
                layers,
                rows=rows,
                row_elements=last,
                dtype=dtype,
                element_size=element_size,
                slot_bytes=last * element_size,
                slots_per_row=1,
            )
        )

    def ring_state(
        family: str, layers: tuple[int, ...], size: int, ratio: int, head_dim: int
    ) -> None:
        ring = g.ring_size(ratio, knobs.speculative)
        es = knobs.state_element_size
        rows = g.state_rows(size, ring, ratio)
        last = g.state_last_dim(head_dim, overlap=ratio == 4)
        state(family, layers, rows, last, knobs.state_torch_dtype, es)

    all_layers = tuple(range(shape.num_hidden_layers))
    c4, c128 = shape.layers(4), shape.layers(128)
    kv("swa_kv", all_layers, sizes.swa_tokens, 0)
    kv("c4_kv", c4, sizes.c4_tokens, 4)
    kv("c128_kv", c128, sizes.c128_tokens, 128)
    idx = g.indexer_entry_bytes(shape.index_head_dim, fp4=knobs.indexer_dtype == "fp4")
    paged("c4_indexer", c4, sizes.c4_indexer_tokens, p // 4, idx, (p // 4) * idx)
    ring_state("c4_attn_state", c4, sizes.c4_state_size, 4, shape.head_dim)
    ring_state("c4_indexer_state", c4, sizes.c4_state_size, 4, shape.index_head_dim)
    ring_state("c128_state", c128, sizes.c128_state_size, 128, shape.head_dim)
    low_idx = planner.low_ratio_index_bytes(shape)
    page = knobs.low_ratio_index_page
    for r in g.LOW_RATIOS:
        sources = shape.sources(r)
        if not sources:
            continue
        kv(f"c{r}_kv", sources, sizes.full_tokens // r, r)
        # The indexer holds (full + page) / r slots in pages of its own, one reserved.
        size = (sizes.full_tokens + p) // r
        paged(f"c{r}_indexer", sources, size, page, low_idx, page * low_idx, reserved=page)
    if shape.sources(2):
        rows = planner.c2_state_rows(shape, knobs, sizes.max_running_requests)
        state(
            "c2_state",
            shape.sources(2),
            rows,
            g.state_last_dim(shape.head_dim, False),
            "float32",
            4,
        )
    return tuple(out)


def _families(
    shape: Dsv4Shape,
    knobs: Knobs,
    sizes: planner.PoolSizes,
    price: planner.Pricing,
    buffers: tuple[Dsv4Buffer, ...],
    fixed_by_family: dict[str, int],
    planning_mrr: int | None,
) -> dict[str, FamilyPlan]:
    p = knobs.page_size
    ring2 = g.ring_size(2, knobs.speculative, knobs.speculative_draft_tokens)
    usable = {
        "swa_kv": sizes.swa_tokens,
        "c4_kv": sizes.c4_tokens,
        "c128_kv": sizes.c128_tokens,
        "c4_indexer": sizes.c4_indexer_tokens,
        "c4_attn_state": sizes.c4_state_size,
        "c4_indexer_state": sizes.c4_state_size,
        "c128_state": sizes.c128_state_size,
        "c1_kv": sizes.full_tokens,
        "c1_indexer": sizes.full_tokens + p,
        "c2_kv": sizes.full_tokens // 2,
        "c2_indexer": (sizes.full_tokens + p) // 2,
        "c2_state": sizes.num_req_slots * ring2,
    }
    present = {b.family for b in buffers}
    names = FAMILIES + tuple(f for f in LOW_RATIO_FAMILIES if f in present)
    out: dict[str, FamilyPlan] = {}
    for family in names:
        bufs = [b for b in buffers if b.family == family]
        if family in fixed_by_family:
            planned = fixed_by_family[family]
        else:
            planned = round(
                sizes.full_tokens * price.family_bytes_per_full_token[family]
                + (price.swa_cap_tokens or 0) * price.family_bytes_per_swa_token.get(family, 0.0)
            )
        first = bufs[0] if bufs else None
        out[family] = FamilyPlan(
            family=family,
            layers=tuple(b.layer for b in bufs),
            planned_bytes=planned if bufs else 0,
            allocated_bytes=sum(b.tensor_bytes for b in bufs),
            usable_slots=usable[family] if bufs else 0,
            capacity_slots=first.capacity_slots if first else 0,
            slot_bytes=first.slot_bytes if first else 0,
            shape=first.shape if first else (),
            dtype=first.dtype if first else "",
            reasons=_reasons(family, shape, knobs, sizes, price, planning_mrr) if bufs else (),
        )
    return out


_KV_RATIO = {"swa_kv": 0, "c4_kv": 4, "c128_kv": 128, "c1_kv": 1, "c2_kv": 2}


def _reasons(
    family: str,
    shape: Dsv4Shape,
    knobs: Knobs,
    sizes: planner.PoolSizes,
    price: planner.Pricing,
    planning_mrr: int | None,
) -> tuple[str, ...]:
    p = knobs.page_size
    out: list[str] = []
    if family in ("swa_kv", "c4_kv", "c128_kv", "c4_indexer", "c1_kv", "c2_kv"):
        out.append(f"one extra logical page ({p} tokens) reserved per buffer")
    if family in _KV_RATIO:
        lay = price.kv_layouts[_KV_RATIO[family]]
        align = g.KV_LAYOUTS[lay][2]
        out.append(f"{lay} pages padded to a multiple of {align} bytes (priced in the planner too)")
    if family in ("c1_kv", "c2_kv"):
        out.append("the reserved page is left out of the planner's coefficient (padding loop)")
    if family in ("c1_indexer", "c2_indexer"):
        out.append(
            f"fp4 indexer for full + {p} tokens in pages of {knobs.low_ratio_index_page} slots, "
            "one more page reserved (padding loop)"
        )
    if family == "c2_state":
        out.append("one pair ring per request slot, + ring + 1 rows, rounded up to 2")
    if family == "swa_kv" and knobs.swa_sizing == "ratio":
        out.append("SWA tokens rounded down to whole pages from ratio x full tokens")
    if family == "c4_indexer" and knobs.indexer_dtype == "fp4":
        out.append("fp4 indexer (68 B) priced at its fp8 size (132 B) by the planner")
    if family in ("c4_attn_state", "c4_indexer_state"):
        out.append("ring + 1 spare rows, rounded up to a multiple of 4")
    if family == "c128_state":
        out.append("ring + 1 spare rows, rounded up to a multiple of 128")
        if planning_mrr is not None and planning_mrr != sizes.max_running_requests:
            out.append(
                f"planned for {planning_mrr} running requests, built for "
                f"{sizes.max_running_requests}"
            )
    return tuple(out)
