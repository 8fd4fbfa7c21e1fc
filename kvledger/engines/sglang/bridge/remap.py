"""The index-mapping rewrite of a compaction: SGLang's `full_to_swa_index_mapping` entries that
point into moved SWA rows, pointed at the rows they moved to.

SGLang 0.5.23 keeps the mapping page-aligned: a full-attention page of `page` tokens is
allocated with one SWA page at the same offsets (`alloc_extend` and `alloc_decode` take both
from the same sequence positions), and the free paths clear whole pages
(`_expand_to_full_pages`). So the non-zero entries of one full page all lie in one SWA row,
and the page's first entry (its representative) names it; SGLang's own
`_free_swa_pages` frees SWA pages by those representatives. The rewrite reads only the
representatives (one entry per full page, 1 / `page` of the mapping), and rewrites the
entries of the full pages whose representative lies in a moved row, each entry checked
against that row (a 0 stays 0). Before, every entry was gathered through an identity table
of every SWA token, O(mapping) per compaction whatever the rows moved.
"""

from __future__ import annotations

from typing import Any


def rewrite(
    mapping: Any, page: int, rows: int, src: Any, dst: Any, *, masked: bool | None = None
) -> int | None:
    """Point the entries of `mapping` that lie in SWA row `src[i]` at the same offset of row
    `dst[i]` (int64 tensors on the mapping's device; the sources were held, the destinations
    free). The last entry is SGLang's -1 and stays. On the host returns the full pages
    rewritten. On a device returns None: selecting the pages to rewrite would read their
    count back (a synchronisation on the scheduler's thread), so every full page is
    rewritten through a mask there instead, one elementwise pass over the mapping queued on
    the stream (the same entries change). `masked` picks the pass (default: on a device)."""
    import torch

    body = mapping[:-1]
    if body.numel() % page:
        raise ValueError(
            f"mapping of {body.numel()} entries (the trailing -1 left out), expected a whole "
            f"number of {page}-token pages"
        )
    by_page = body.view(-1, page)
    dev = mapping.device
    shift = torch.zeros(rows, dtype=mapping.dtype, device=dev)  # tokens each row moves by
    shift[src] = (dst - src).to(mapping.dtype) * page
    rep_rows = torch.div(by_page[:, 0], page, rounding_mode="floor")
    if masked if masked is not None else dev.type != "cpu":
        own_all = rep_rows.unsqueeze(1)
        step = shift[rep_rows].unsqueeze(1)  # 0 for a page whose row did not move
        in_row = torch.div(by_page, page, rounding_mode="floor") == own_all
        by_page.copy_(torch.where(in_row, by_page + step, by_page))
        return None
    hit = torch.nonzero(shift[rep_rows]).squeeze(1)
    if hit.numel() == 0:
        return 0
    block = by_page[hit]
    own = rep_rows[hit].unsqueeze(1)
    moved = torch.div(block, page, rounding_mode="floor") == own  # own >= 1: a 0 stays
    by_page[hit] = torch.where(moved, block + shift[own], block)
    return int(hit.numel())
