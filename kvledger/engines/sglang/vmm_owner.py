"""SGLang's own VMM-backed KV buffers, as the ledger counts them.

With post-capture KV sizing (SGLang 0.5.23, `sglang/srt/mem_cache/kv_vmm_backing.py`),
a pool's buffers are `KvVmmBufferOwner` tensors: one `KvVmmArena` (a CUDA VMM
reservation exposed to torch as a `torch.cuda.MemPool`) holds every buffer's virtual
extent, a page is backed before graph capture (`ensure_prefix`), and
`ModelRunner.post_capture_resize_kv_pool` backs each buffer's final span
(`finalize`). Such a buffer is not an ordinary tensor: its tensor spans the whole
reservation, its device memory is the backed prefix.

kvledger reports it as a VMM-owned buffer: reserved bytes are its virtual extent (the
reserved span rounded up to the arena's granularity), physical and mapped bytes its
backed span (SGLang maps every handle it creates and keeps it until close), a page the
arena's granularity. Each buffer is an account of its own (buffers of one owner may be
backed to different spans). The plugin re-registers the pool after
`post_capture_resize_kv_pool`, so the figures follow the resize.

torch counts the arena's segments at their virtual extent in `memory_reserved`; the
arena's pool id (`arena_pool_ids`) tells `accounting.torch_memory` to leave them out.

Duck-typed over the attributes SGLang 0.5.23 gives `KvVmmBufferOwner` (`tensors`,
`_specs` of `_BufferSpec` with `aligned_reserved`, `reserved_span`, `backed_to`,
`_arena` with `granularity`, `pool`); imports neither sglang nor torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_SUB_POOLS = ("full_kv_pool", "swa_kv_pool")


@dataclass(frozen=True)
class Backed:
    """One buffer of a KvVmmBufferOwner."""

    name: str
    reserved_bytes: int  # the virtual extent: reserved span rounded up to the granularity
    tensor_bytes: int  # the reserved span (the tensor's bytes)
    backed_bytes: int  # the span backed now (a whole number of granules)
    granularity: int


StorageKey = tuple[str, int]


def owners(pool: Any) -> list[Any]:
    """The KvVmmBufferOwners of `pool` and its sub-pools (`_post_capture_owner`), each once."""
    out: list[Any] = []
    for obj in (pool, *(getattr(pool, a, None) for a in _SUB_POOLS)):
        owner = getattr(obj, "_post_capture_owner", None) if obj is not None else None
        if owner is not None and _looks_like_owner(owner) and all(o is not owner for o in out):
            out.append(owner)
    return out


def _looks_like_owner(owner: Any) -> bool:
    return all(hasattr(owner, a) for a in ("tensors", "_specs", "_arena"))


def _buffers(owner: Any) -> Iterator[tuple[Any, Any]]:
    arena = owner._arena
    if arena is None:  # closed
        return
    yield from zip(owner.tensors, owner._specs, strict=False)


def backed_buffers(pool: Any) -> dict[StorageKey, Backed]:
    """Every VMM-backed buffer of `pool`, by its tensor's storage (device, data pointer)."""
    out: dict[StorageKey, Backed] = {}
    for owner in owners(pool):
        gran = int(owner._arena.granularity) if owner._arena is not None else 0
        for tensor, spec in _buffers(owner):
            key = (str(tensor.device), int(tensor.untyped_storage().data_ptr()))
            out[key] = Backed(
                name=str(getattr(spec.desc, "name", "")),
                reserved_bytes=int(spec.aligned_reserved),
                tensor_bytes=int(spec.reserved_span),
                backed_bytes=int(spec.backed_to),
                granularity=gran,
            )
    return out


def backed_bytes(pool: Any) -> int:
    """Device memory the pool's KvVmmBufferOwners have backed (their arenas' total)."""
    return sum(int(o.backed_bytes) for o in owners(pool))


def arena_pool_ids(pool: Any) -> list[tuple[int, int]]:
    """The torch MemPool ids of the pool's VMM arenas (torch counts their virtual extent)."""
    out = []
    for owner in owners(pool):
        arena = owner._arena
        mem_pool = getattr(arena, "pool", None) if arena is not None else None
        pid = getattr(mem_pool, "id", None)
        if pid is not None:
            out.append((int(pid[0]), int(pid[1])))
    return out
