"""A KV family's slots from SGLang's own counts: the index space it counts in, and how.

SGLang counts tokens; each family of a pool counts its slots in one of three spaces
(`Units.space`): the full-token space (`FULL`), the SWA space (`SWA`) or the request
slots (`REQ`), `slots = count * num // den` of that space's count. `dsv4_units` gives
DeepSeek-V4's families (docs/background.md#the-families), `GENERIC_UNITS` an MHA pool's.
Used by the holder reader (`kvledger.engines.sglang.holders`) and the per-request footprints
(`kvledger.engines.sglang.footprints`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FULL, SWA, REQ = "full", "swa", "req"


@dataclass(frozen=True)
class Units:
    """A family's slots from SGLang's counts in `space`: slots = count * num // den."""

    space: str  # FULL (tokens of the full space), SWA (SWA tokens) or REQ (request slots)
    num: int = 1
    den: int = 1

    def of(self, count: int) -> int:
        return count * self.num // self.den


def dsv4_units(pool: Any) -> dict[str, Units]:
    """The DeepSeek-V4 families' units, from the pool's ring sizes and layout
    (docs/background.md#the-families)."""
    page = int(getattr(pool, "swa_page_size", None) or getattr(pool, "page_size", None) or 256)
    ring4 = _ring(pool, 4, 8)
    ring128 = _ring(pool, 128, 128)
    unified = bool(getattr(pool, "_unified_kv", False))
    c4_state = Units(REQ, ring4) if unified else Units(SWA, ring4, page)
    return {
        "swa_kv": Units(SWA),
        "c4_kv": Units(FULL, 1, 4),
        "c4_indexer": Units(FULL, 1, 4),
        "c128_kv": Units(FULL, 1, 128),
        "c4_attn_state": c4_state,
        "c4_indexer_state": c4_state,
        "c128_state": Units(REQ, ring128),
    }


GENERIC_UNITS = {
    "k": Units(FULL),
    "v": Units(FULL),
    "kv": Units(FULL),
    "swa_k": Units(SWA),
    "swa_v": Units(SWA),
    "swa_kv": Units(SWA),
}


def _ring(pool: Any, ratio: int, default: int) -> int:
    get = getattr(pool, "get_ring_size", None)
    try:
        return int(get(ratio)) if callable(get) else default
    except Exception:
        return default
