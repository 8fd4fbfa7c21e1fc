"""The DeepSeek-V4 buffer map: every buffer of the seven families, and plan vs allocation.

`plan()` sizes the pools as SGLang 0.5.23 does (kvledger.sglang.dsv4.planner) and
lays out each buffer as `DeepSeekV4TokenToKVPool` allocates it
(kvledger.sglang.dsv4.geometry). Per family it sets the planner's predicted bytes
beside the real allocation; they part over page padding (a 256-token page of
584-byte entries is padded to 576-byte multiples), the extra logical page every
paged sub-pool reserves, state rows rounded up to the ratio, the fp4 indexer
priced as fp8, and request counts that differ between planning and building.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from accounting.buffers import BufferSpec, Owner
from allocator.backend import DEFAULT_GRANULARITY
from kvledger.sglang.dsv4 import geometry as g
from kvledger.sglang.dsv4 import planner
from kvledger.sglang.dsv4.knobs import Knobs
from kvledger.sglang.dsv4.shape import Dsv4Shape

FAMILIES: tuple[str, ...] = (
    "swa_kv",
    "c4_kv",
    "c128_kv",
    "c4_indexer",
    "c4_attn_state",
    "c4_indexer_state",
    "c128_state",
)

# What one slot of each family is, for tables and docs.
SLOT_MEANING: dict[str, str] = {
    "swa_kv": "token",
    "c4_kv": "compressed row (4 tokens)",
    "c128_kv": "compressed row (128 tokens)",
    "c4_indexer": "compressed row (4 tokens)",
    "c4_attn_state": "ring row",
    "c4_indexer_state": "ring row",
    "c128_state": "ring row",
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
    families: dict[str, FamilyPlan]  # every family of FAMILIES, in that order
    budget_bytes: int | None = None
    planning_max_running_requests: int | None = None
    fixed_bytes: int = 0  # planned outside the per-token coefficient: c128 state, SWA cap
    _by_family: dict[str, tuple[Dsv4Buffer, ...]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def family_buffers(self, family: str) -> tuple[Dsv4Buffer, ...]:
        if family not in self.families:
            raise KeyError(f"unknown family {family!r}, expected one of {', '.join(FAMILIES)}")
        if not self._by_family:
            for f in FAMILIES:
                self._by_family[f] = tuple(b for b in self.buffers if b.family == f)
        return self._by_family[family]

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
            },
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
            f"shape={shape!r}, expected a Dsv4Shape (kvledger.sglang.dsv4.load_config)"
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
    else:
        assert full_tokens is not None
        sizes = planner.sizes_for_full_tokens(shape, knobs, full_tokens)
        c128_fixed = planner.c128_state_fixed_bytes(shape, knobs, sizes.max_running_requests)
    swa_fixed = (price.swa_cap_tokens or 0) * price.bytes_per_swa_token
    fixed = round(c128_fixed + swa_fixed)
    buffers = _buffers(shape, knobs, sizes)
    families = _families(shape, knobs, sizes, price, buffers, c128_fixed, planning_mrr)
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


def _buffers(shape: Dsv4Shape, knobs: Knobs, sizes: planner.PoolSizes) -> tuple[Dsv4Buffer, ...]:
    p = knobs.page_size
    entry = g.kv_entry_bytes(shape.qk_nope_head_dim, shape.qk_rope_head_dim)
    out: list[Dsv4Buffer] = []

    def paged(
        family: str, layers: tuple[int, ...], size: int, per_page: int, slot: int, row: int
    ) -> None:
        """A page of `per_page` slots per uint8 row of `row` bytes (the padded page)."""
        pages = g.physical_pages(size, per_page, p)
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

    def state(family: str, layers: tuple[int, ...], size: int, ratio: int, head_dim: int) -> None:
        """One compress-state entry per row."""
        ring = g.ring_size(ratio, knobs.speculative)
        last = g.state_last_dim(head_dim, overlap=ratio == 4)
        es = knobs.state_element_size
        out.extend(
            _per_layer(
                family,
                layers,
                rows=g.state_rows(size, ring, ratio),
                row_elements=last,
                dtype=knobs.state_torch_dtype,
                element_size=es,
                slot_bytes=last * es,
                slots_per_row=1,
            )
        )

    all_layers = tuple(range(shape.num_hidden_layers))
    c4, c128 = shape.layers(4), shape.layers(128)
    paged("swa_kv", all_layers, sizes.swa_tokens, p, entry, g.kv_page_bytes(p, entry))
    paged("c4_kv", c4, sizes.c4_tokens, p // 4, entry, g.kv_page_bytes(p // 4, entry))
    paged("c128_kv", c128, sizes.c128_tokens, p // 128, entry, g.kv_page_bytes(p // 128, entry))
    idx = g.indexer_entry_bytes(shape.index_head_dim, fp4=knobs.indexer_dtype == "fp4")
    paged("c4_indexer", c4, sizes.c4_indexer_tokens, p // 4, idx, (p // 4) * idx)
    state("c4_attn_state", c4, sizes.c4_state_size, 4, shape.head_dim)
    state("c4_indexer_state", c4, sizes.c4_state_size, 4, shape.index_head_dim)
    state("c128_state", c128, sizes.c128_state_size, 128, shape.head_dim)
    return tuple(out)


def _families(
    shape: Dsv4Shape,
    knobs: Knobs,
    sizes: planner.PoolSizes,
    price: planner.Pricing,
    buffers: tuple[Dsv4Buffer, ...],
    c128_fixed: int,
    planning_mrr: int | None,
) -> dict[str, FamilyPlan]:
    usable = {
        "swa_kv": sizes.swa_tokens,
        "c4_kv": sizes.c4_tokens,
        "c128_kv": sizes.c128_tokens,
        "c4_indexer": sizes.c4_indexer_tokens,
        "c4_attn_state": sizes.c4_state_size,
        "c4_indexer_state": sizes.c4_state_size,
        "c128_state": sizes.c128_state_size,
    }
    out: dict[str, FamilyPlan] = {}
    for family in FAMILIES:
        bufs = [b for b in buffers if b.family == family]
        if family == "c128_state":
            planned = c128_fixed
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
            reasons=_reasons(family, shape, knobs, sizes, planning_mrr) if bufs else (),
        )
    return out


def _reasons(
    family: str, shape: Dsv4Shape, knobs: Knobs, sizes: planner.PoolSizes, planning_mrr: int | None
) -> tuple[str, ...]:
    p = knobs.page_size
    out: list[str] = []
    if family in ("swa_kv", "c4_kv", "c128_kv", "c4_indexer"):
        out.append(f"one extra logical page ({p} tokens) reserved per buffer")
    if family in ("swa_kv", "c4_kv", "c128_kv"):
        out.append("pages padded to a multiple of 576 bytes (priced in the planner too)")
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
