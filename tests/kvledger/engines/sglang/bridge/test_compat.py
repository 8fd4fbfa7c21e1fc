"""The bridge's compatibility rules over plain facts (no sglang)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvledger.engines.sglang.bridge.compat import (
    V4_TOKEN_BYTES,
    WRAPPED_METHODS,
    SwaFacts,
    expected_row_bytes,
    incompatibilities,
    layout_token_bytes,
    pool_reasons,
)

GRAN = 2 << 20
ROWS = 9
ROW = 149760

# What SGLang 0.5.23 builds for DeepSeek-V4 (V4 layout, page 256) with 8 SWA pages, 3 layers.
GOOD = SwaFacts(
    pool_class="DeepSeekV4TokenToKVPool",
    is_dsv4_pool=True,
    has_swa_pool=True,
    swa_storage="paged",
    kv_layout="v4",
    uniform_fp8=False,
    token_bytes=V4_TOKEN_BYTES,
    page_tokens=256,
    allocator_page_tokens=256,
    allocator_pages=ROWS - 1,
    allocator_class="PagedTokenToKVPoolAllocator",
    allocator_missing=(),
    layers=3,
    shapes=((ROWS, ROW),) * 3,
    dtypes=("uint8",) * 3,
    contiguous=(True,) * 3,
    devices=("cpu",) * 3,
)


def reasons(**changes: Any) -> list[str]:
    return incompatibilities(
        dataclasses.replace(GOOD, **changes), granularity=GRAN, backend_device="cpu"
    )


def test_row_bytes_is_256_tokens_padded_to_576() -> None:
    assert expected_row_bytes(256) == 149760 == 260 * 576
    assert expected_row_bytes(64) == 65 * 576  # 37,376 bytes of tokens round up
    assert expected_row_bytes(2) == 3 * 576


def test_sglangs_v4_pool_is_compatible() -> None:
    assert reasons() == []
    assert (GOOD.rows, GOOD.row_bytes) == (ROWS, ROW)


@pytest.mark.parametrize(("layout", "row"), [("v41", 135168), ("v41_new", 135168)])
def test_sglangs_v41_pools_are_compatible(layout: str, row: int) -> None:
    """V4.1's 528-byte tokens: 256 of them fill 264 x 512 (v41) or 256 x 528 (v41_new) bytes,
    no padding either way."""
    assert expected_row_bytes(256, layout) == row == 256 * 528
    assert layout_token_bytes(layout) == 528
    assert reasons(kv_layout=layout, token_bytes=528, shapes=((ROWS, row),) * 3) == []
    # The V4 row is wrong for a V4.1 pool, named with the layout.
    (why,) = reasons(kv_layout=layout, token_bytes=528)
    assert f"expected {row}" in why and f"the {layout} layout" in why
    assert expected_row_bytes(2, "v41") == 3 * 512 and expected_row_bytes(2, "v41_new") == 2 * 528


@pytest.mark.parametrize(
    ("storage", "why"),
    [
        ("request_window", "encoder replay"),
        ("unified", "unified-KV ring"),
        ("ring", "draft SWA ring"),
    ],
)
def test_storage_without_a_paged_pool_is_refused_naming_it(storage: str, why: str) -> None:
    (reason,) = reasons(has_swa_pool=False, swa_storage=storage)
    assert f"SWA storage is {storage!r}" in reason and why in reason
    assert reason.endswith("expected 'paged'")


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"is_dsv4_pool": False, "pool_class": "MHATokenToKVPool"}, "MHATokenToKVPool"),
        ({"has_swa_pool": False, "swa_storage": "unified"}, "'unified'"),
        ({"has_swa_pool": False, "swa_storage": "request_window"}, "'request_window'"),
        ({"kv_layout": "v41_fp4"}, "layout 'v41_fp4', expected one of v4, v41, v41_new"),
        ({"kv_layout": "uniform_fp8"}, "layout 'uniform_fp8'"),
        ({"kv_layout": "v41", "token_bytes": 584}, "token bytes 584, expected 528 (the v41"),
        ({"uniform_fp8": True}, "uniform-FP8"),
        ({"token_bytes": 512}, "token bytes 512"),
        ({"page_tokens": 64}, "page of 64 tokens"),
        ({"allocator_missing": ("_release_page_ids",)}, "lacks _release_page_ids"),
        ({"layers": 4}, "3 SWA buffers for 4 layers"),
        ({"shapes": ((ROWS, ROW), (ROWS, ROW), (ROWS + 1, ROW))}, "expected one 2-D shape"),
        ({"shapes": ((ROWS * ROW,),) * 3}, "expected one 2-D shape"),
        ({"dtypes": ("uint8", "float8_e4m3fn", "uint8")}, "expected uint8"),
        ({"contiguous": (True, False, True)}, "not contiguous"),
        ({"devices": ("cuda:0",) * 3}, "expected cpu"),
        ({"shapes": ((ROWS, ROW + 64),) * 3}, f"expected {ROW}"),
        ({"allocator_pages": ROWS}, "a row for each page"),
    ],
)
def test_each_mismatch_names_its_reason(changes: dict[str, object], why: str) -> None:
    got = reasons(**changes)
    assert got and any(why in r for r in got), got


def test_a_row_larger_than_the_vmm_page_is_refused() -> None:
    got = incompatibilities(GOOD, granularity=64 << 10, backend_device="cpu")
    assert got == [
        f"SWA row of {ROW} bytes exceeds the VMM page of {64 << 10} bytes, expected one row "
        "to touch at most two pages"
    ]


def test_pool_reasons_come_alone() -> None:
    facts = dataclasses.replace(GOOD, has_swa_pool=False, swa_storage="ring", kv_layout="v41")
    assert pool_reasons(facts) == incompatibilities(facts, granularity=GRAN, backend_device="cpu")
    assert len(pool_reasons(facts)) == 1
    assert pool_reasons(GOOD) == []


def _writes_free_pages(fn: Any) -> bool:
    """Whether `fn`'s source assigns `self.free_pages` (plainly, in a tuple, augmented, or an
    item or slice of it) or calls a method on it (an in-place change)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))

    def is_free_pages(node: ast.AST) -> bool:
        while isinstance(node, ast.Subscript):
            node = node.value
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "free_pages"
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        )

    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and is_free_pages(node.func.value)
        ):
            return True
        for t in targets:
            parts = t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]
            if any(is_free_pages(p) for p in parts):
                return True
    return False


@pytest.mark.sglang
def test_wrapped_methods_are_every_method_that_moves_pages_on_or_off_the_free_list() -> None:
    """The claim behind WRAPPED_METHODS, read from SGLang 0.5.23's own class: the methods of
    PagedTokenToKVPoolAllocator (its own and inherited, as the instance resolves them) that
    change `self.free_pages` are exactly those wrapped; every other way back to the list goes
    through `_release_page_ids` (so a release elsewhere is seen there). A SGLang release that
    adds such a method, or stops funnelling, fails here."""
    import inspect

    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator as Paged

    methods = {
        name: fn
        for name, fn in inspect.getmembers(Paged, inspect.isfunction)
        if name != "__init__"  # builds the list (and calls `clear`, which is wrapped)
    }
    writers = {name for name, fn in methods.items() if _writes_free_pages(fn)}
    assert writers == set(WRAPPED_METHODS), (
        f"methods that change free_pages: {sorted(writers)}, wrapped: {sorted(WRAPPED_METHODS)}"
    )
    assert len(WRAPPED_METHODS) == len(set(WRAPPED_METHODS))
    # Pages come back only through the funnel: the frees reach `_release_page_ids`.
    funnel = {n for n, fn in methods.items() if "self._release_page_ids(" in inspect.getsource(fn)}
    assert funnel >= {"free", "free_page_ids", "free_group_end"}
