"""The metrics of a vLLM source, declared once (`kvledger.engines.vllm.export` registers
them with the exporter): a worker's bytes, an engine core's blocks, each per KV-cache group
where it says so.

Every name is under a prefix of kvledger's own, `kvledger_vllm_`, which vLLM's `vllm:` names
can never take, and carries vLLM's labels (`model_name`, `engine`; a worker's also `tp_rank`,
`pp_rank`), then the group's (`group`, `kind`), never SGLang's.
"""

from __future__ import annotations

from exporter.metrics import MetricSpec
from kvledger.engines.vllm.views import ENGINE_LABELS, GROUP_LABELS, WORKER_LABELS

PREFIX = "kvledger_vllm_"


def _specs() -> tuple[MetricSpec, ...]:
    """A vLLM source's metrics (docs/vllm.md): a worker's bytes, an engine core's blocks."""
    w, e = "worker", "engine"
    aliased = (
        "vLLM (0.32 to 0.34) lays every group out from byte 0 of the worker's one KV storage "
        "(0.34's extensible cache: one virtual reservation), so groups alias it: this is that "
        "storage's figure for each group, never to be added over groups "
        "(kvledger_vllm_kv_cache_physical_bytes counts the physical bytes once)."
    )
    rows = [
        (
            "kv_cache_physical_bytes",
            w,
            (),
            "Device memory of the worker's KV storage, counted once for all groups: the one "
            "int8 buffer vLLM allocates (its tensor, reserved and physical bytes are equal), or "
            "with vLLM 0.34's extensible KV cache the granules committed in its reservation "
            "now (0 while released for sleep).",
        ),
        (
            "kv_cache_blocks",
            w,
            (),
            "Blocks the worker's KV storage can address (KVCacheConfig.num_blocks when it "
            "was allocated; with vLLM 0.34's extensible KV cache, the reservation's capacity); "
            "a block id is one block in every layer of every group.",
        ),
        (
            "kv_block_bytes",
            w,
            (),
            "Bytes of one block id in the worker's storage, all layers of "
            "all groups: free blocks x this is the worker's available KV memory.",
        ),
        (
            "kv_cache_committed_blocks",
            w,
            (),
            "Blocks of kv_cache_blocks backed by device memory now: all of them for an "
            "ordinary storage; with vLLM 0.34's extensible KV cache the committed prefix "
            "(0 while released for sleep), which the engine core's kvledger_vllm_blocks "
            "matches once vLLM sized the cache after warm-up.",
        ),
        (
            "group_tensor_bytes",
            w,
            GROUP_LABELS,
            "numel x element_size of the group's layer views, "
            "summed over its layers: the bytes the group addresses in the storage.",
        ),
        (
            "group_reserved_bytes",
            w,
            GROUP_LABELS,
            "Address range of the storage the group's views lie in. " + aliased,
        ),
        (
            "group_physical_bytes",
            w,
            GROUP_LABELS,
            "Device memory held for the storage the group's views lie in. " + aliased,
        ),
        (
            "group_slot_bytes",
            w,
            GROUP_LABELS,
            "Bytes one slot (a token; a Mamba group's state) takes "
            "over all the group's layers: the group's bytes per token on this worker.",
        ),
        (
            "group_block_size",
            w,
            GROUP_LABELS,
            "Slots per block of the group: vLLM's block_size in "
            "tokens for an attention group, 1 for a state (Mamba) group.",
        ),
        ("group_layers", w, GROUP_LABELS, "Layers (attention layers' KV views) in the group."),
        (
            "blocks",
            e,
            (),
            "Blocks of the engine core's block pool (num_gpu_blocks, the null "
            "block included), shared by every KV-cache group.",
        ),
        ("occupied_blocks", e, (), "Blocks in use (ref count > 0, the null block included)."),
        (
            "evictable_blocks",
            e,
            (),
            "Free blocks still holding a cached prefix (ref count 0): "
            "reused on a prefix hit, evicted when handed out; 0 without prefix caching. A subset "
            "of kvledger_vllm_free_blocks.",
        ),
        (
            "free_blocks",
            e,
            (),
            "Blocks not in use (blocks - occupied_blocks), the evictable ones "
            "included: what new requests can take.",
        ),
        (
            "held_blocks",
            e,
            ("holder",),
            "Blocks holding KV, by holder (SGLang's holder names, accounting.figures): "
            "tree_protected (in use and in the prefix cache), request_only (in use, not cached; "
            "the null block among them), unattributed (in use, holder not read), tree_evictable "
            "(free but cached: = kvledger_vllm_evictable_blocks). tree_protected + request_only "
            "+ unattributed = kvledger_vllm_occupied_blocks, vLLM's blocks in use.",
        ),
        (
            "group_capacity_slots",
            e,
            GROUP_LABELS,
            "Slots the group can address: blocks x its slots "
            "per block (tokens; a Mamba group's states).",
        ),
        (
            "group_occupied_slots",
            e,
            GROUP_LABELS,
            "The group's slots held by running requests (its "
            "distinct blocks in use x slots per block; a block shared by a prefix hit counts "
            "once, as vLLM's pool counts it). Occupied bytes on a worker = this x "
            "that worker's kvledger_vllm_group_slot_bytes.",
        ),
        (
            "group_evictable_slots",
            e,
            GROUP_LABELS,
            "The pool's evictable blocks as the group's slots "
            "(evictable_blocks x slots per block): the pool is shared by all groups.",
        ),
        (
            "group_free_slots",
            e,
            GROUP_LABELS,
            "The pool's free blocks as the group's slots "
            "(free_blocks x slots per block, evictable ones included).",
        ),
        (
            "group_held_slots",
            e,
            (*GROUP_LABELS, "holder"),
            "The group's slots by holder (SGLang's holder names): tree_protected (its blocks "
            "in use and in the prefix cache), request_only (in use, not cached), unattributed "
            "(in use, holder not read); these three add up to kvledger_vllm_group_occupied_slots. "
            "tree_evictable: the group's own free blocks still cached (ref count 0), outside "
            "occupied. Read from each cached block's key (it names its group) as vLLM caches "
            "and frees blocks, never by walking the pool.",
        ),
        (
            "running_requests",
            e,
            (),
            "Requests the engine core's scheduler was running when it last published "
            "(Scheduler.running): the count of kvledger_vllm_request_slots.",
        ),
    ]
    scopes = {w: WORKER_LABELS, e: ENGINE_LABELS}
    gauges = tuple(
        MetricSpec(PREFIX + name, "gauge", text, (*scopes[scope], *labels), engine=False)
        for name, scope, labels, text in rows
    )
    footprints = MetricSpec(
        PREFIX + "request_slots",
        "histogram",
        "Each running request's slots in the group (tokens; a Mamba group's states), as vLLM's "
        "group manager holds them for it (req_to_blocks, null blocks left out) times the "
        "group's slots per block; a gauge histogram of the requests running at the last "
        "publish. A block shared through the prefix cache counts in every request that holds "
        "it, so _sum may exceed kvledger_vllm_group_occupied_slots. A request's bytes on a "
        "worker = its slots x that worker's kvledger_vllm_group_slot_bytes.",
        (*ENGINE_LABELS, *GROUP_LABELS),
        engine=False,
    )
    return (*gauges, footprints)


METRICS: tuple[MetricSpec, ...] = _specs()


if __name__ == "__main__":
    from exporter.metrics import markdown_table

    print(markdown_table(METRICS))
