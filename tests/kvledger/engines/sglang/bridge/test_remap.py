"""The compaction's index-mapping rewrite (kvledger.engines.sglang.bridge.remap) against the rewrite of
every entry through an identity table (what compaction did before), on page-aligned mappings
as SGLang 0.5.23 keeps them: each full page's set entries in one SWA row, same offsets."""

from __future__ import annotations

import random

import pytest
import torch

from kvledger.engines.sglang.bridge import remap

PAGE = 8
ROWS = 40  # SWA rows, row 0 the padding row
FULL_PAGES = 60


def aligned_mapping(rng: random.Random) -> tuple[torch.Tensor, list[int]]:
    """A mapping of FULL_PAGES full pages (+ one page + SGLang's trailing -1): about half the
    full pages own a distinct SWA row, filled from offset 0 to a random length; the rest 0.
    Returns it and the rows held."""
    body = torch.zeros((FULL_PAGES + 1) * PAGE, dtype=torch.int64)
    rows = rng.sample(range(1, ROWS), 25)
    for row, full in zip(rows, rng.sample(range(FULL_PAGES), len(rows)), strict=True):
        n = rng.randint(1, PAGE)
        body[full * PAGE : full * PAGE + n] = torch.arange(row * PAGE, row * PAGE + n)
    return torch.cat([body, torch.tensor([-1])]), rows


def reference(mapping: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    to_new = torch.arange(ROWS * PAGE, dtype=mapping.dtype).view(ROWS, PAGE)
    to_new[src] = to_new[dst].clone()
    out = mapping.clone()
    out[:-1] = to_new.view(-1)[mapping[:-1]]
    return out


@pytest.mark.parametrize("masked", [False, True], ids=["selected", "masked"])
@pytest.mark.parametrize("seed", range(20))
def test_rewrite_matches_the_whole_mapping_rewrite(seed: int, masked: bool) -> None:
    """Both passes: the host's (the pages to rewrite selected) and the device's (every page
    through a mask, nothing read back), here on the host."""
    rng = random.Random(seed)
    mapping, held = aligned_mapping(rng)
    free = [r for r in range(1, ROWS) if r not in held]
    k = rng.randint(1, min(len(free), 8))
    src = torch.tensor(rng.sample(held, k))
    dst = torch.tensor(rng.sample(free, k))
    want = reference(mapping, src, dst)
    pages = remap.rewrite(mapping, PAGE, ROWS, src, dst, masked=masked)
    assert torch.equal(mapping, want)
    assert pages == (None if masked else k)  # each held row is one full page's
    assert int(mapping[-1]) == -1


def test_the_masked_pass_leaves_unmoved_rows_and_zeros_alone() -> None:
    mapping, held = aligned_mapping(random.Random(5))
    free = [r for r in range(1, ROWS) if r not in held]
    before = mapping.clone()
    src, dst = torch.tensor(free[:2]), torch.tensor(free[2:4])  # rows no entry points into
    assert remap.rewrite(mapping, PAGE, ROWS, src, dst, masked=True) is None
    assert torch.equal(mapping, before)


def test_no_moved_row_in_the_mapping_rewrites_nothing() -> None:
    mapping, held = aligned_mapping(random.Random(3))
    free = [r for r in range(1, ROWS) if r not in held]
    before = mapping.clone()
    src, dst = torch.tensor(free[:2]), torch.tensor(free[2:4])  # rows no entry points into
    assert remap.rewrite(mapping, PAGE, ROWS, src, dst) == 0
    assert torch.equal(mapping, before)


def test_a_mapping_not_of_whole_pages_is_refused() -> None:
    mapping = torch.zeros(PAGE * 3 + 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="whole number of 8-token pages"):
        remap.rewrite(mapping, PAGE, ROWS, torch.tensor([1]), torch.tensor([2]))
