"""kvledger.tools.bench.sglang_pool: sizes from pages, bad sizes refused, and SGLang's own pool,
request pool and SWA allocator built from them (the latter marked `sglang`)."""

from __future__ import annotations

import pytest

from kvledger.tools.bench.sglang_pool import Sizes, build_allocator, build_pool, build_req_to_token


def test_from_pages_derives_sglang_sizes() -> None:
    s = Sizes.from_pages(requests=4, swa_pages=8, full_pages=20, page=256)
    assert s == Sizes(
        requests=4,
        slots=5,
        swa_tokens=8 * 256,
        c4_tokens=20 * 256 // 4,
        c128_tokens=20 * 256 // 128,
        c4_state_size=8 * 9,
        c128_state_size=128 * 5,
        full_tokens=20 * 256,
    )


@pytest.mark.parametrize("name", ["requests", "swa_pages", "full_pages", "page"])
@pytest.mark.parametrize("bad", [0, -1, True, 2.0, None])
def test_from_pages_refuses_a_bad_count_naming_it(name: str, bad: object) -> None:
    kw: dict[str, object] = {"requests": 4, "swa_pages": 8, "full_pages": 20, "page": 256}
    kw[name] = bad
    with pytest.raises(ValueError, match=rf"^{name}={bad!r}, expected a positive int$"):
        Sizes.from_pages(**kw)  # type: ignore[arg-type]


def test_sizes_refuse_a_bad_field_naming_it() -> None:
    good = Sizes.from_pages(requests=4, swa_pages=8, full_pages=20, page=256)
    with pytest.raises(ValueError, match=r"^Sizes\.c4_tokens=0, expected a positive int$"):
        Sizes(**{**vars(good), "c4_tokens": 0})
    with pytest.raises(ValueError, match=r"^Sizes\.full_tokens=-256, expected a positive int$"):
        Sizes(**{**vars(good), "full_tokens": -256})
    assert Sizes(**{**vars(good), "full_tokens": None}).full_tokens is None


@pytest.mark.sglang
def test_builds_sglang_pool_request_pool_and_allocator_of_those_sizes() -> None:
    import torch

    from tests.kvledger.engines.sglang.sglang_reference import published

    sizes = Sizes.from_pages(requests=3, swa_pages=6, full_pages=12, page=256)
    with published(page_size=256, swa_full_tokens_ratio=0.1):
        pool = build_pool(sizes, ratios=[0, 4, 128], page=256, window=128, device="cpu")
        assert pool.max_num_reqs == 3
        assert pool.num_req_slots == 4
        assert pool.swa_size == 6 * 256
        assert pool.c128_size == 12 * 256 // 128
        assert pool.compression_ratios == [0, 4, 128]
        assert pool.layer_num == 3
        r2t = build_req_to_token(3, 1024, "cpu")
        assert r2t.size == 3
        assert tuple(r2t.req_to_token.shape) == (3 + 1, 1024)  # SGLang's padding row 0
        alloc = build_allocator(pool, r2t, full_tokens=12 * 256, page=256, device="cpu")
        assert alloc.size_full == 12 * 256
        assert alloc.size_swa == 6 * 256
        assert alloc.page_size == 256
        assert alloc.dtype == torch.float8_e4m3fn
        # A pool of more layers than ratios needs `layers`; a bad one is refused by name.
        with pytest.raises(ValueError, match=r"^layers=0, expected a positive int$"):
            build_pool(sizes, ratios=[0, 4], layers=0, page=256, window=128, device="cpu")
