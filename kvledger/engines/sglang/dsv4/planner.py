"""SGLang 0.5.23's DeepSeek-V4 planner: a byte budget (or a token count) to pool sizes.

Restates `DSV4PoolConfigurator` (sglang/srt/model_executor/pool_configurator.py)
for the path modelled here (CUDA, the V4 and V4.1 paged layouts, paged SWA
sized by ratio or cap, offline compression, one pipeline stage, no DP
attention, no PD disaggregation):

    kv_bytes_per_entry(r)   = page bytes of (page_size / r) entries / (page_size / r), in
                              ratio r's layout (V4: 585 for r = 0 and 4, 864 for r = 128 at
                              page 256; V4.1 fp8: 528, 528, 768; V4.1 fp4 for r = 1, 2: 288)
    bytes_per_swa_token     = kv_bytes_per_entry(0) * L
                              + ring4 / page_size * 4 * (head_dim + index_head_dim) * s * n4
    bytes_per_full_token    = ratio * bytes_per_swa_token
                              + n4 * (kv_bytes_per_entry(4) + 132) / 4
                              + n128 * kv_bytes_per_entry(128) / 128
                              + sum over r in (1, 2): s_r * (kv_bytes_per_entry(r) + 68) / r
                              (x (L + 1) / L with speculative decoding: the draft worker)
    c128_state_fixed_bytes  = ceil((slots * ring128 + ring128 + 1) / 128) * 128
                              * 2 * head_dim * s * n128,   slots = max_running_requests + 1
    c2_state_fixed_bytes    = ceil((slots * ring2 + ring2 + 1) / 2) * 2 * 2 * head_dim * 4 * s_2
    full_tokens             = floor(int((budget - fixed) / bytes_per_full_token) / page) * page,
                              less a page while full_tokens * bytes_per_full_token plus the
                              low-ratio pages reserved beyond it (low_ratio_padding_bytes)
                              exceed budget - fixed

(s_r: the kv_source layers of low ratio r, the only ratio-1/2 layers owning
buffers; their indexer is fp4, 68 bytes a slot, whatever the c4 indexer dtype;
ring2 the ratio-2 pair ring, 2 rows.)
In SWA cap mode (`_resolve_swa_cap_tokens`, `compute_swa_request_cap`) the SWA
term leaves the coefficient and becomes fixed bytes:

    per_request             = window + eviction_interval + page_size + page_size
    cap                     = per_request * max_running_requests
                              + chunks_in_flight * chunked_prefill_size + page_size
    swa_cap_tokens          = ceil_align(cap + prefix_tails * (window + page_size), page_size)
    fixed                  += swa_cap_tokens * bytes_per_swa_token

(chunks_in_flight 2, or 1 with --disable-overlap-schedule; prefix_tails from
--swa-prefix-tails, else 0 with --disable-radix-cache, else 4 x requests.)

(L layers, n4 / n128 layers of ratio 4 / 128, s the state element size; the
indexer is priced at its fp8 size even with the fp4 indexer, as SGLang 0.5.23
does on NVIDIA.) Sizes then follow `_compute_dsv4_sizes` and
`finalize_with_max_running_requests`; the request count the pools are built
with follows `KVCacheConfigurator.resolve_max_num_reqs`
(sglang/srt/mem_cache/kv_cache_configurator.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvledger.engines.sglang.dsv4 import geometry as g
from kvledger.engines.sglang.dsv4.knobs import Knobs
from kvledger.engines.sglang.dsv4.shape import Dsv4Shape


@dataclass(frozen=True)
class PoolSizes:
    """The token and row counts SGLang passes to DeepSeekV4TokenToKVPool."""

    full_tokens: int
    swa_tokens: int
    c4_tokens: int
    c128_tokens: int
    c4_state_size: int
    c128_state_size: int
    max_running_requests: int

    @property
    def num_req_slots(self) -> int:
        # ReqToTokenPool allocates size + 1 rows; the pool gets req_to_token.shape[0].
        return self.max_running_requests + 1

    @property
    def c4_indexer_tokens(self) -> int:
        # DeepSeekV4TokenToKVPool: c4_logical_size = c128_size * 32.
        return self.c128_tokens * 32


@dataclass(frozen=True)
class Pricing:
    """The planner's coefficients for one shape and set of knobs."""

    kv_bytes_per_entry: dict[int, float]  # ratio -> padded page bytes per entry
    bytes_per_swa_token: float  # both with the speculative (L+1)/L inflation, as SGLang's
    bytes_per_full_token: float  # what the budget is divided by
    spec_inflation: float
    family_bytes_per_full_token: dict[str, float]  # token-scaled families, uninflated
    family_bytes_per_swa_token: dict[str, float]  # the SWA-priced families, uninflated
    swa_cap_tokens: int | None = None  # cap mode: SWA tokens, priced as fixed bytes
    kv_layouts: dict[int, str] = field(default_factory=dict)  # ratio -> KV layout (0: SWA)


RATIOS = (0, 1, 2, 4, 128)


def kv_layouts(shape: Dsv4Shape, knobs: Knobs) -> dict[int, str]:
    """The KV layout of each ratio's cache: the SWA (main) layout for 0,
    resolve_compressed_kv_layout beside it for the others."""
    main = knobs.resolved_kv_layout(shape.has_low_ratios)
    out = {0: main}
    for r in RATIOS[1:]:
        out[r] = g.compressed_layout(main, r, knobs.compressed_kv_layout)
    return out


def entry_bytes(shape: Dsv4Shape, layout: str) -> int:
    return g.layout_token_bytes(layout, shape.qk_nope_head_dim, shape.qk_rope_head_dim)


def low_ratio_index_bytes(shape: Dsv4Shape) -> int:
    """The ratio-1/2 indexer entry: always fp4 (SGLang builds those pools with force_fp4)."""
    return g.indexer_entry_bytes(shape.index_head_dim, fp4=True)


def pricing(shape: Dsv4Shape, knobs: Knobs) -> Pricing:
    p = knobs.page_size
    layouts = kv_layouts(shape, knobs)
    kvpt = {}
    for r in (0, 4, 128, *(r for r in g.LOW_RATIOS if shape.sources(r))):
        per_page = p // r if r else p
        lay = layouts[r]
        kvpt[r] = g.layout_page_bytes(lay, per_page, entry_bytes(shape, lay)) / per_page
    layers = shape.num_hidden_layers
    n4, n128 = len(shape.layers(4)), len(shape.layers(128))
    s = knobs.state_element_size
    ring4 = g.ring_size(4, knobs.speculative)
    per_swa_state = ring4 / p * n4  # state rows per SWA token, summed over c4 layers
    per_swa = {
        "swa_kv": kvpt[0] * layers,
        "c4_attn_state": per_swa_state * g.state_last_dim(shape.head_dim, True) * s,
        "c4_indexer_state": per_swa_state * g.state_last_dim(shape.index_head_dim, True) * s,
    }
    cap = swa_cap_tokens(shape, knobs)
    ratio = 0.0 if cap is not None else knobs.swa_full_tokens_ratio
    fam = {f: ratio * v for f, v in per_swa.items()}
    fam["c4_kv"] = n4 * kvpt[4] / 4
    # Priced at the fp8 size whatever the indexer dtype (NVIDIA path of 0.5.23).
    fam["c4_indexer"] = n4 * g.indexer_entry_bytes(shape.index_head_dim, fp4=False) / 4
    fam["c128_kv"] = n128 * kvpt[128] / 128
    for r in g.LOW_RATIOS:
        n = len(shape.sources(r))
        if n:
            fam[f"c{r}_kv"] = n * kvpt[r] / r
            fam[f"c{r}_indexer"] = n * low_ratio_index_bytes(shape) / r
    swa_token = sum(per_swa.values())
    full_token = ratio * swa_token + sum(v for f, v in fam.items() if f not in per_swa)
    infl = (layers + 1) / layers if knobs.speculative else 1.0
    return Pricing(
        kv_bytes_per_entry=kvpt,
        bytes_per_swa_token=swa_token * infl,
        bytes_per_full_token=full_token * infl,
        spec_inflation=infl,
        family_bytes_per_full_token=fam,
        family_bytes_per_swa_token=per_swa,
        swa_cap_tokens=cap,
        kv_layouts=layouts,
    )


def swa_cap_tokens(shape: Dsv4Shape, knobs: Knobs) -> int | None:
    """DSV4PoolConfigurator._resolve_swa_cap_tokens with compute_swa_request_cap (no
    speculative decoding, not a PD decode server); None in ratio mode."""
    if knobs.swa_sizing != "cap":
        return None
    assert knobs.max_running_requests is not None and knobs.chunked_prefill_size is not None
    p, window = knobs.page_size, shape.sliding_window
    per_request = window + knobs.swa_eviction_interval * 1 + p + p  # draft tokens 1, decode p
    chunks = 1 if knobs.disable_overlap_schedule else 2
    cap = per_request * knobs.max_running_requests + chunks * knobs.chunked_prefill_size + p
    if knobs.swa_prefix_tails is not None:
        tails = knobs.swa_prefix_tails
    else:
        tails = 0 if knobs.disable_radix_cache else 4 * knobs.max_running_requests
    return g.ceil_div(cap + tails * (window + p), p) * p


def c128_state_fixed_bytes(shape: Dsv4Shape, knobs: Knobs, max_running_requests: int) -> int:
    """DSV4PoolConfigurator._get_c128_state_fixed_bytes (offline compression)."""
    n128 = len(shape.layers(128))
    if n128 == 0:
        return 0
    ring = g.ring_size(128, knobs.speculative)
    rows = g.state_rows((max_running_requests + 1) * ring, ring, 128)
    return rows * g.state_last_dim(shape.head_dim, False) * knobs.state_element_size * n128


def c2_state_rows(shape: Dsv4Shape, knobs: Knobs, max_running_requests: int) -> int:
    """Rows of one ratio-2 pair-state pool (`_make_pair_state_pool`): one ring per request
    slot, plus ring + 1, rounded up to 2."""
    ring = g.ring_size(2, knobs.speculative, knobs.speculative_draft_tokens)
    return g.state_rows((max_running_requests + 1) * ring, ring, 2)


def c2_state_fixed_bytes(shape: Dsv4Shape, knobs: Knobs, max_running_requests: int) -> int:
    """DSV4PoolConfigurator._get_c2_state_fixed_bytes: fp32 (kv, score) rows of head_dim
    each on every ratio-2 kv_source layer."""
    n2 = len(shape.sources(2))
    if n2 == 0:
        return 0
    rows = c2_state_rows(shape, knobs, max_running_requests)
    return rows * g.state_last_dim(shape.head_dim, False) * 4 * n2


def low_ratio_padding_bytes(
    shape: Dsv4Shape, knobs: Knobs, price: Pricing, full_tokens: int
) -> float:
    """DSV4PoolConfigurator._get_low_ratio_kv_padding_bytes: the ratio-1/2 KV pool's
    reserved logical page and the indexer slots past full_tokens / r, per source layer."""
    p, page = knobs.page_size, knobs.low_ratio_index_page
    out = 0.0
    for r in g.LOW_RATIOS:
        n = len(shape.sources(r))
        if not n:
            continue
        main = p * price.kv_bytes_per_entry[r]
        index_slots = g.physical_pages((full_tokens + p) // r, page, page) * page
        index = (index_slots - full_tokens // r) * low_ratio_index_bytes(shape)
        out += (main + index) * n
    return out


def context_length(shape: Dsv4Shape, knobs: Knobs) -> int:
    return knobs.context_length if knobs.context_length is not None else shape.context_length


def planning_max_running_requests(
    shape: Dsv4Shape, knobs: Knobs, price: Pricing, budget_bytes: int
) -> int:
    """DSV4PoolConfigurator._resolve_max_running_requests_per_worker: the requested count, or
    an estimate from the budget before fixed bytes: clamp(full / context * 512, 2048, 4096),
    at most full // 2."""
    if knobs.max_running_requests is not None:
        return knobs.max_running_requests
    full = int(budget_bytes / price.bytes_per_full_token)
    estimated = max(min(int(full / context_length(shape, knobs) * 512), 4096), 2048)
    return min(estimated, full // 2)


def resolved_max_running_requests(shape: Dsv4Shape, knobs: Knobs, full_tokens: int) -> int:
    """KVCacheConfigurator.resolve_max_num_reqs: what the pools are built with."""
    if knobs.max_running_requests is not None:
        return min(knobs.max_running_requests, full_tokens // 2)
    estimated = max(min(int(full_tokens / context_length(shape, knobs) * 512), 4096), 2048)
    return min(estimated, full_tokens // 2)


def swa_tokens(full_tokens: int, knobs: Knobs, cap: int | None = None) -> int:
    """DSV4PoolConfigurator._get_swa_tokens: the cap in cap mode, else ratio x full tokens."""
    if cap is not None:
        return cap
    p = knobs.page_size
    return int(full_tokens * knobs.swa_full_tokens_ratio) // p * p


def swa_admits_a_request(swa: int, shape: Dsv4Shape, knobs: Knobs) -> bool:
    """MemoryPoolConfigurator.validate_swa_pool_size: sliding_window + page_size < swa_tokens."""
    return shape.sliding_window + knobs.page_size < swa


def sizes_for_full_tokens(shape: Dsv4Shape, knobs: Knobs, full_tokens: int) -> PoolSizes:
    """_compute_dsv4_sizes + finalize_with_max_running_requests for a full-token count."""
    p = knobs.page_size
    full = full_tokens // p * p
    cap = swa_cap_tokens(shape, knobs)
    swa = swa_tokens(full, knobs, cap)
    if full <= 0 and cap is not None:
        raise ValueError(f"full_tokens={full_tokens}, expected at least one page ({p})")
    if cap is None and (full <= 0 or not swa_admits_a_request(swa, shape, knobs)):
        need = min_full_tokens(shape, knobs)
        raise ValueError(
            f"full_tokens={full_tokens} gives {swa} SWA tokens (ratio "
            f"{knobs.swa_full_tokens_ratio}, pages of {p}), expected more than sliding_window "
            f"+ page_size = {shape.sliding_window + p}: at least {need} full tokens"
        )
    mrr = resolved_max_running_requests(shape, knobs, full)
    ring4 = g.ring_size(4, knobs.speculative)
    ring128 = g.ring_size(128, knobs.speculative)
    return PoolSizes(
        full_tokens=full,
        swa_tokens=swa,
        c4_tokens=full // 4,
        c128_tokens=full // 128,
        c4_state_size=swa // p * ring4 if shape.layers(4) else 0,
        c128_state_size=(mrr + 1) * ring128 if shape.layers(128) else 0,
        max_running_requests=mrr,
    )


def min_full_tokens(shape: Dsv4Shape, knobs: Knobs) -> int:
    """The fewest full tokens (whole pages) whose SWA share admits one request."""
    p = knobs.page_size
    if knobs.swa_sizing == "cap":
        return p
    # swa_tokens grows with full_tokens; the first admitting SWA size is the next page
    # above window + page, reached at about that / ratio full tokens.
    target = (shape.sliding_window + p) // p * p + p
    full = max(p, int(target / knobs.swa_full_tokens_ratio) // p * p - p)
    while not swa_admits_a_request(swa_tokens(full, knobs), shape, knobs):
        full += p
    return full


@dataclass(frozen=True)
class BudgetSolution:
    full_tokens: int
    planning_max_running_requests: int
    c128_state_fixed_bytes: int  # priced at the planning request count
    swa_fixed_bytes: float  # cap mode: swa_cap_tokens x bytes_per_swa_token
    c2_state_fixed_bytes: int = 0  # V4.1 ratio-2 pair state, at the planning request count

    @property
    def fixed_bytes(self) -> float:
        return self.c128_state_fixed_bytes + self.c2_state_fixed_bytes + self.swa_fixed_bytes


def _solve(shape: Dsv4Shape, knobs: Knobs, price: Pricing, budget_bytes: int) -> BudgetSolution:
    mrr = planning_max_running_requests(shape, knobs, price, budget_bytes)
    c128 = c128_state_fixed_bytes(shape, knobs, max(mrr, 0))
    c2 = c2_state_fixed_bytes(shape, knobs, max(mrr, 0))
    swa_fixed = (
        0.0 if price.swa_cap_tokens is None else price.swa_cap_tokens * price.bytes_per_swa_token
    )
    available = max(budget_bytes - (c128 + c2 + swa_fixed), 0)
    p = knobs.page_size
    full = int(available / price.bytes_per_full_token) // p * p
    if shape.has_low_ratios:
        # The coefficient leaves out the reserved low-ratio pages: drop pages until they fit.
        while (
            full > 0
            and full * price.bytes_per_full_token
            + low_ratio_padding_bytes(shape, knobs, price, full)
            > available
        ):
            full -= p
    return BudgetSolution(full, mrr, c128, swa_fixed, c2)


def _usable(shape: Dsv4Shape, knobs: Knobs, price: Pricing, sol: BudgetSolution) -> bool:
    if sol.full_tokens <= 0 or sol.planning_max_running_requests <= 0:
        return False
    if price.swa_cap_tokens is not None:
        return True
    return swa_admits_a_request(swa_tokens(sol.full_tokens, knobs), shape, knobs)


def solve_budget(
    shape: Dsv4Shape, knobs: Knobs, price: Pricing, budget_bytes: int
) -> BudgetSolution:
    """DSV4PoolConfigurator.calculate_pool_sizes."""
    sol = _solve(shape, knobs, price, budget_bytes)
    if not _usable(shape, knobs, price, sol):
        need = min_budget_bytes(shape, knobs, price)
        notes = []
        if sol.c128_state_fixed_bytes:
            notes.append(
                f"{sol.c128_state_fixed_bytes} bytes of it go to c128 state for "
                f"{sol.planning_max_running_requests} running requests first"
            )
        if sol.c2_state_fixed_bytes:
            notes.append(f"{sol.c2_state_fixed_bytes} bytes to ratio-2 pair state")
        if sol.swa_fixed_bytes:
            notes.append(
                f"{round(sol.swa_fixed_bytes)} bytes to the {price.swa_cap_tokens}-token SWA cap"
            )
        raise ValueError(
            f"budget_bytes={budget_bytes} is too small for one page per buffer: SGLang 0.5.23 "
            f"sizes {max(sol.full_tokens, 0)} full tokens from it, expected at least "
            f"{min_full_tokens(shape, knobs)} (a budget of at least {need} bytes"
            + "".join(f"; {n}" for n in notes)
            + ")"
        )
    return sol


def min_budget_bytes(shape: Dsv4Shape, knobs: Knobs, price: Pricing) -> int:
    """The smallest budget `solve_budget` accepts (found by bisection)."""
    lo, hi = 0, 1
    while not _usable(shape, knobs, price, _solve(shape, knobs, price, hi)):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _usable(shape, knobs, price, _solve(shape, knobs, price, mid)):
            hi = mid
        else:
            lo = mid
    return hi
