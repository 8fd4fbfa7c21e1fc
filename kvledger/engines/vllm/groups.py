"""A worker's KV cache as vLLM 0.33 allocated it, as ledger accounts.

vLLM 0.33 (`vllm/v1/worker/utils.py`, `allocate_kv_cache`) allocates one backing
buffer per worker (`torch.zeros(size, dtype=torch.int8)`, the `size` every
`KVCacheTensor` of the `KVCacheConfig` carries) and hands each layer a view into it.
Its planner (`vllm/v1/core/kv_cache_planning.py`, `get_kv_cache_config_from_groups`)
lays every KV-cache group out from byte 0 of that buffer: groups alias the same bytes,
which is sound because a block id belongs to one group at a time.

So the bytes are counted once, on the storage, and the groups are described by what
they address:

- account `kv_pool` (family `kv_pool`): one buffer per distinct storage the layers'
  tensors live in (one in 0.33), tensor = reserved = physical = its bytes; slots are
  blocks (`capacity_slots` = `num_blocks`, `slot_bytes` = the storage's bytes per block);
- account `g<i>_<kind>` per KV-cache group `i` (kind from vLLM's own
  `get_kv_cache_spec_kind`: `full_attention`, `sliding_window`, `mla_attention`,
  `sliding_window_mla`, `mamba`, ..., or `unknown`): one buffer per layer view, named by
  the layer, with the view's shape and dtype, `slot_bytes` = that layer's bytes per slot,
  `capacity_slots` = the group's slots (tokens: `num_blocks * block_size`; a Mamba
  group's slots are its states, one per block). Their tensor and reserved bytes are 0:
  the views alias `kv_pool`'s storage, and counting them too would count it once per
  group. The bytes a group's view addresses are `slot_bytes * capacity_slots`.

Layers found in the allocation but in no group (a layer sharing another's cache is
added to its target's group by vLLM itself) are a group of their own, kind `unknown`.

vLLM 0.34 with its extensible (VMM) KV cache: the groups are laid out the same way, over
one virtual reservation whose physical memory vLLM commits block by block. Then `kv_pool`
is a VMM-owned account that follows the committed granules (`kvledger.engines.vllm.
extensible`), beside `kv_pool_committed` (the blocks backed now); the group accounts are
as above, their views addressing the whole reservation.
Nothing here imports vLLM or torch: the config and tensors are read by attribute.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from accounting.buffers import BufferSpec, Owner, dtype_name
from accounting.ledger import Account, Ledger
from kvledger.engines.vllm.extensible import CommitFollower

POOL_FAMILY = "kv_pool"
UNKNOWN = "unknown"
# Kinds whose slot is a state (one per block), not a token.
STATE_KINDS = frozenset({"mamba"})
_LAYER_INDEX = re.compile(r"\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class GroupLayout:
    """One KV-cache group as the ledger carries it."""

    index: int
    kind: str
    family: str
    block_size: int
    num_blocks: int
    capacity_slots: int
    layers: tuple[str, ...]

    @property
    def slots_per_block(self) -> int:
        return 1 if self.kind in STATE_KINDS else self.block_size


def family_of(index: int, kind: str) -> str:
    return f"g{index}_{kind}"


def layer_index(name: str) -> int | None:
    """`model.layers.12.self_attn.attn` -> 12; None when the name has no number."""
    m = _LAYER_INDEX.search(name)
    return int(m.group(1)) if m else None


def layouts(config: Any, kind_of: Callable[[Any], str]) -> list[GroupLayout]:
    """The groups of a vLLM `KVCacheConfig`, in vLLM's order."""
    num_blocks = _count(config.num_blocks, "KVCacheConfig.num_blocks")
    out = []
    for i, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        try:
            kind = str(kind_of(spec)) or UNKNOWN
        except Exception:
            kind = UNKNOWN
        block_size = _count(spec.block_size, f"group {i} block_size")
        slots = num_blocks * (1 if kind in STATE_KINDS else block_size)
        out.append(
            GroupLayout(
                i, kind, family_of(i, kind), block_size, num_blocks, slots, tuple(group.layer_names)
            )
        )
    return out


def group_specs(
    layout: GroupLayout, tensors: Mapping[str, Any], *, pool: str
) -> tuple[BufferSpec, ...]:
    """One buffer per layer view of the group (aliasing: no bytes of its own)."""
    specs = []
    for name in layout.layers:
        t = tensors.get(name)
        if t is None:
            continue
        view = int(t.numel()) * int(t.element_size())
        specs.append(
            BufferSpec(
                name=name,
                family=layout.family,
                pool=pool,
                owner=Owner.RUNTIME,
                layer=layer_index(name),
                dtype=dtype_name(t.dtype),
                shape=tuple(int(s) for s in t.shape),
                slot_bytes=view // layout.capacity_slots if layout.capacity_slots else 0,
                capacity_slots=layout.capacity_slots,
                tensor_bytes=0,
                reserved_bytes=0,
            )
        )
    return tuple(specs)


def storages(tensors: Mapping[str, Any]) -> dict[tuple[str, int], int]:
    """(device, data pointer) -> bytes of every distinct storage the tensors live in."""
    out: dict[tuple[str, int], int] = {}
    for t in tensors.values():
        st = t.untyped_storage()
        out.setdefault((str(t.device), int(st.data_ptr())), int(st.nbytes()))
    return out


def pool_specs(tensors: Mapping[str, Any], num_blocks: int, *, pool: str) -> tuple[BufferSpec, ...]:
    found = storages(tensors)
    specs = []
    for n, ((_device, _ptr), nbytes) in enumerate(sorted(found.items())):
        specs.append(
            BufferSpec(
                name="kv_cache" if len(found) == 1 else f"kv_cache{n}",
                family=POOL_FAMILY,
                pool=pool,
                owner=Owner.RUNTIME,
                layer=None,
                dtype="int8",
                shape=(nbytes,),
                slot_bytes=nbytes // num_blocks if num_blocks else 0,
                capacity_slots=num_blocks,
                tensor_bytes=nbytes,
                reserved_bytes=nbytes,
            )
        )
    return tuple(specs)


@dataclass
class Registered:
    """What `register_worker_cache` added: remove it with `release`."""

    pool: str
    layouts: list[GroupLayout]
    pool_account: Account | None
    group_accounts: dict[int, Account]
    # vLLM 0.34's extensible KV cache: its `kv_pool` and `kv_pool_committed` accounts
    follower: CommitFollower | None = None

    @property
    def accounts(self) -> list[Account]:
        head = [self.pool_account] if self.pool_account is not None else []
        if self.follower is not None:
            head += [
                a
                for a in (self.follower.pool_account, self.follower.committed_account)
                if a is not None
            ]
        return head + list(self.group_accounts.values())

    def release(self, ledger: Ledger) -> None:
        for account in reversed(list(self.group_accounts.values())):
            ledger.remove_account(account)
        self.group_accounts = {}
        if self.follower is not None:
            self.follower.release(ledger)
            self.follower = None
        if self.pool_account is not None:
            ledger.remove_account(self.pool_account)
            self.pool_account = None


def register_worker_cache(
    ledger: Ledger,
    config: Any,
    tensors: Mapping[str, Any],
    *,
    kind_of: Callable[[Any], str],
    pool: str = "vllm",
    extensible: Any = None,
) -> Registered:
    """Add the worker's KV cache (`kv_caches` as `initialize_kv_cache_tensors` returns it, or
    the V2 runner's `kv_caches_by_layer`) to `ledger`: account `kv_pool` for the storage, one
    account per group. `extensible`: vLLM 0.34's ExtensibleKVCache the views lie in (then
    `kv_pool` follows its committed granules), or None."""
    groups = layouts(config, kind_of)
    grouped = {name for g in groups for name in g.layers}
    stray = tuple(name for name in tensors if name not in grouped)
    if stray:
        first = groups[0] if groups else None
        groups.append(
            GroupLayout(
                len(groups),
                UNKNOWN,
                family_of(len(groups), UNKNOWN),
                first.block_size if first else 1,
                first.num_blocks if first else int(config.num_blocks),
                first.capacity_slots if first else int(config.num_blocks),
                stray,
            )
        )
    done = Registered(pool, groups, None, {})
    try:
        if extensible is not None:
            done.follower = CommitFollower(ledger, extensible, pool=pool)
        else:
            specs = pool_specs(tensors, int(config.num_blocks), pool=pool)
            if specs:
                done.pool_account = ledger.add_account(specs, key=f"{pool}/{POOL_FAMILY}")
        for g in groups:
            gspecs = group_specs(g, tensors, pool=pool)
            if gspecs:
                done.group_accounts[g.index] = ledger.add_account(
                    gspecs, key=f"{pool}/{g.family}", capacity_slots=g.capacity_slots
                )
    except BaseException:
        done.release(ledger)
        raise
    return done


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what}={value!r}, expected a non-negative int")
    return value
