"""kvledger's hooks on SGLang 0.5.23, registered through SGLang's `HookRegistry` only.

| target (dotted path) | type | what kvledger does |
|---|---|---|
| `ModelRunner._init_post_memory_pool_components` | BEFORE | registers the pools the runner has just built (`RankLedger.add_runner`), attaching the DeepSeek-V4 bridge when asked; the first pool starts the publisher |
| `ModelRunner.init_cuda_graphs` | AFTER | re-baselines NVML truth (after each runner's capture): modules and graphs loaded so far are named, not unattributed |
| `ModelRunner.post_capture_resize_kv_pool` | AFTER | post-capture KV sizing backed each pool's final span and set its size: the runner's pool and its drafts' are registered anew (`RankLedger.refresh_runner`), SGLang's VMM-backed buffers with their new backed span |
| `Scheduler.release_host_resources` | AFTER | graceful scheduler exit: the publisher stops and its file goes |
| `Scheduler.__init__` | AFTER | the scheduler's tree cache, allocator, request pool and running batch are handed to a `kvledger.engines.sglang.holders.HolderReader` for the target pool (`RankLedger.attach_scheduler`) |
| `UnifiedRadixCache._evict` | AFTER | the tokens the tree evicted (its `EvictResult`, full and SWA) are added to `holders.PRESSURE` |
| `free_swa_out_of_window_slots` (in `mem_cache.common` and where `unified_cache.components.swa` imported it) | AROUND | the SWA tokens a window eviction freed (the request's evicted length after minus before) are added to `holders.PRESSURE` |
| `ScheduleBatch.retract_decode` | AFTER | the requests it retracted are added to `holders.PRESSURE` |
| `Scheduler.process_batch_result` | AFTER | SGLang's normal loop only (no overlap): the batch has run, none is in flight; a bridged pool compacts if due (`RankLedger.compact_step`) |
| `Scheduler.on_idle` | AFTER | no batch in flight in either loop: the same |

The pressure hooks do O(1) work (an attribute read and an addition) and never raise.

Compaction (docs/sglang-bridge.md#compaction-in-a-server) runs only where SGLang has no
batch in flight and nothing else holds SWA ids across batches: it is skipped, with one log
line saying why, under the overlap loop's batch results, pipeline parallelism, PD
disaggregation or PD multiplexing, HiCache and HiSparse; `KVLEDGER_SGLANG_DSV4_COMPACT=0`
turns it off.

Why BEFORE `_init_post_memory_pool_components` rather than AFTER `alloc_memory_pool`:
`alloc_memory_pool` sets `token_to_kv_pool` and `token_to_kv_pool_allocator` and then
calls `_init_post_memory_pool_components`, whose first step builds the KV index
translator from the pool, then the canary, the HiSparse coordinator and the capturers,
some of which keep the pool's buffers. Attention backends (`init_attention_backends`)
and CUDA graph capture (`init_cuda_graphs`) come after all of it. Hooking there is the
first moment the pool and its allocator exist and the last before anything reads a
buffer or its address; it also covers forks that build bespoke pools and then call
`_init_post_memory_pool_components` themselves.

Every hook catches its own failure, logs one line and lets SGLang carry on, unless
`KVLEDGER_SGLANG_REQUIRE=1` (any failure re-raised) or the bridge's own require switch
raised (`IncompatibleError`). An `atexit` handler closes the publisher too (SGLang
starts schedulers with multiprocessing's spawn method, whose children exit through
`sys.exit`, so atexit handlers run); SIGTERM's default action and SIGKILL (what
`Engine.shutdown` sends the schedulers) run neither: the file stays, and `kvledger
serve` reports the source stale because its pid is gone.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Any

from kvledger.engines.sglang.switches import (
    DEFAULT_PUBLISH_INTERVAL,
    PUBLISH_INTERVAL,
    plugin_required,
)

log = logging.getLogger(__name__)

MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
POOLS_BUILT = f"{MODEL_RUNNER}._init_post_memory_pool_components"
GRAPHS_CAPTURED = f"{MODEL_RUNNER}.init_cuda_graphs"
KV_RESIZED = f"{MODEL_RUNNER}.post_capture_resize_kv_pool"
SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
SCHEDULER_EXIT = f"{SCHEDULER}.release_host_resources"
SCHEDULER_READY = f"{SCHEDULER}.__init__"
BATCH_DONE = f"{SCHEDULER}.process_batch_result"
IDLE = f"{SCHEDULER}.on_idle"
TREE_EVICT = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache._evict"
WINDOW_EVICT = (
    "sglang.srt.mem_cache.common.free_swa_out_of_window_slots",
    "sglang.srt.mem_cache.unified_cache.components.swa.free_swa_out_of_window_slots",
)
RETRACT = "sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode"
TARGETS = (
    POOLS_BUILT,
    GRAPHS_CAPTURED,
    KV_RESIZED,
    SCHEDULER_EXIT,
    SCHEDULER_READY,
    TREE_EVICT,
    *WINDOW_EVICT,
    RETRACT,
    BATCH_DONE,
    IDLE,
)

_lock = threading.Lock()
_rank: Any = None  # this process's RankLedger, built by the first runner that builds pools
_disabled = ""  # why kvledger stopped in this process after a failure
_installed = False
_refusals: dict[int, str] = {}  # id(scheduler) -> why it may not compact ("" when it may)


def install() -> None:
    """Register kvledger's hooks with SGLang's HookRegistry (once per process)."""
    global _installed
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    with _lock:
        if _installed:
            return
        HookRegistry.register(POOLS_BUILT, on_pools_built, HookType.BEFORE)
        HookRegistry.register(GRAPHS_CAPTURED, on_graphs_captured, HookType.AFTER)
        HookRegistry.register(KV_RESIZED, on_kv_resized, HookType.AFTER)
        HookRegistry.register(SCHEDULER_EXIT, on_scheduler_exit, HookType.AFTER)
        HookRegistry.register(BATCH_DONE, on_batch_done, HookType.AFTER)
        HookRegistry.register(IDLE, on_idle, HookType.AFTER)
        HookRegistry.register(SCHEDULER_READY, on_scheduler_ready, HookType.AFTER)
        HookRegistry.register(TREE_EVICT, count_tree_eviction, HookType.AFTER)
        for target in WINDOW_EVICT:
            HookRegistry.register(target, count_window_eviction, HookType.AROUND)
        HookRegistry.register(RETRACT, count_retraction, HookType.AFTER)
        _installed = True


def current() -> Any:
    """This process's RankLedger, or None before any pool (or after a failure)."""
    return _rank


def on_pools_built(runner: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ModelRunner._init_post_memory_pool_components(self): register its pools."""
    _guard("registering the KV pools", _add_runner, runner)


def on_graphs_captured(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ModelRunner.init_cuda_graphs(self, ...): re-baseline device truth. Each runner's
    capture (target, then drafts) re-baselines; the figure is cumulative from the baseline."""
    _guard("re-baselining device truth", _rebaseline, "after ModelRunner.init_cuda_graphs")


def on_kv_resized(
    result: Any, runner: Any, *args: Any, draft_runners: Any = (), **kwargs: Any
) -> None:
    """AFTER ModelRunner.post_capture_resize_kv_pool(self, *, draft_runners=()): the pools'
    final spans are backed; register them anew."""
    _guard("following the post-capture KV resize", _refresh, runner, tuple(draft_runners or ()))


def on_scheduler_exit(result: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Scheduler.release_host_resources(self): stop publishing, remove the file."""
    _guard("closing at scheduler exit", shutdown)


def on_batch_done(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Scheduler.process_batch_result(self, batch, result): in the normal loop the
    batch has run; under the overlap loop the next one is already in flight (skipped)."""
    if _rank is not None and not getattr(scheduler, "enable_overlap", False):
        _guard("compacting the bridged pool", _compact, scheduler)


def on_idle(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Scheduler.on_idle(self): no batch in flight in either loop."""
    if _rank is not None:
        _guard("compacting the bridged pool", _compact, scheduler)


def compaction_refusal(scheduler: Any) -> str:
    """Why compaction may not run in `scheduler`'s loops, or "" when it may: SWA ids held
    across batches (HiCache, HiSparse, PD transfers) or batches in flight at every point
    the hooks see (pipeline parallelism, PD multiplexing)."""
    mode = getattr(scheduler, "disaggregation_mode", None)
    if mode is not None and getattr(mode, "value", mode) != "null":
        return f"PD disaggregation ({getattr(mode, 'value', mode)}): transfers hold SWA ids"
    if getattr(scheduler, "enable_pdmux", False):
        return "PD multiplexing: batches in flight on other streams"
    if getattr(scheduler, "enable_hierarchical_cache", False):
        return "HiCache: host copies hold SWA ids across batches"
    if getattr(scheduler, "enable_hisparse", False):
        return "HiSparse: its coordinator holds SWA ids across batches"
    pp = getattr(scheduler, "pp_size", None)
    if pp is None:
        try:
            from sglang.srt.runtime_context import get_parallel

            pp = get_parallel().pp_size
        except Exception:  # not a server's scheduler (tests): no pipeline
            pp = 1
    if int(pp) > 1:
        return f"pipeline parallelism (pp_size={pp}): micro-batches in flight"
    return ""


def _compact(scheduler: Any) -> None:
    rank = _rank
    if rank is None or _disabled:
        return
    refusal = _refusals.get(id(scheduler))
    if refusal is None:
        refusal = _refusals[id(scheduler)] = compaction_refusal(scheduler)
        if refusal and rank.compaction.enabled:
            log.info("kvledger: the bridged pool is not compacted: %s", refusal)
    if not refusal:
        rank.compact_step()


def on_scheduler_ready(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Scheduler.__init__(self, ...): read the holders from its tree cache."""
    _guard("reading the KV holders", _attach_scheduler, scheduler)


def _attach_scheduler(scheduler: Any) -> None:
    rank = _rank
    if rank is not None and not _disabled:
        reader = rank.attach_scheduler(scheduler)
        if reader is not None:
            log.info("kvledger: KV holders read from %s", reader.state().holders_from)


def count_tree_eviction(result: Any, *args: Any, pressure: Any = None, **kwargs: Any) -> None:
    """AFTER UnifiedRadixCache._evict: its EvictResult's tokens into the pressure totals."""
    try:
        from kvledger.engines.sglang.holders import PRESSURE

        (pressure or PRESSURE).tree_evicted(
            getattr(result, "num_tokens_evicted", 0), getattr(result, "swa_num_tokens_evicted", 0)
        )
    except Exception:  # counting must never fail SGLang's eviction
        pass


def count_window_eviction(original: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND free_swa_out_of_window_slots(req, pre_len, ...): SGLang's call, then the SWA
    tokens it freed (the request's evicted length after minus before) counted."""
    before = _evicted_seqlen(req, kwargs)
    out = original(req, *args, **kwargs)
    try:
        after = _evicted_seqlen(req, kwargs)
        if before is not None and after is not None and after > before:
            from kvledger.engines.sglang.holders import PRESSURE

            PRESSURE.window_evicted(after - before)
    except Exception:
        pass
    return out


def _evicted_seqlen(req: Any, kwargs: dict[str, Any]) -> int | None:
    try:
        from sglang.srt.mem_cache.base_prefix_cache import ComponentType

        ct = kwargs.get("component_type", ComponentType.SWA)
        if ct != ComponentType.SWA:
            return None
        return int(req.kv.get_evicted_seqlen(ct))
    except Exception:
        return None


def count_retraction(result: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ScheduleBatch.retract_decode: (retracted, ratio, aborted); the retracted counted."""
    try:
        from kvledger.engines.sglang.holders import PRESSURE

        PRESSURE.retracted(len(result[0]))
    except Exception:
        pass


def shutdown() -> None:
    """Close this process's RankLedger (publisher stopped, file removed). Idempotent."""
    global _rank
    with _lock:
        rank, _rank = _rank, None
    if rank is not None:
        rank.close(release_pools=False)


def reset() -> None:
    """Close everything and forget the failure state (tests; a process re-initialising)."""
    global _rank, _disabled
    with _lock:
        rank, _rank, _disabled = _rank, None, ""
        _refusals.clear()
    if rank is not None:
        rank.close()


# -- internals ----------------------------------------------------------------------------------
def _add_runner(runner: Any) -> None:
    global _rank
    if _disabled:
        return
    with _lock:
        rank = _rank
        created = rank is None
        if created:
            rank = _new_rank()
            _rank = rank
    try:
        record = rank.add_runner(runner)
    except BaseException:
        if created:
            with _lock:
                _rank = None
            rank.close()
        raise
    log.info(
        "kvledger: pool %s (%s on %s%s) published to %s",
        record.name,
        record.pool_class,
        record.device,
        ", SWA on kvledger's VMM pool" if record.bridged else "",
        rank.publisher.path if rank.publisher is not None else "?",
    )


def _new_rank() -> Any:
    from kvledger.engines.sglang.plugin.labels import scheduler_metric_labels
    from kvledger.engines.sglang.plugin.rank import RankLedger
    from kvledger.engines.sglang.plugin.snapdir import snapshot_dir

    raw = os.environ.get(PUBLISH_INTERVAL, "") or str(DEFAULT_PUBLISH_INTERVAL)
    try:
        interval = float(raw)
    except ValueError:
        raise ValueError(
            f"{PUBLISH_INTERVAL}={raw!r}, expected a positive number of seconds"
        ) from None
    rank = RankLedger(scheduler_metric_labels(), directory=snapshot_dir(), interval=interval)
    atexit.register(shutdown)
    return rank


def _refresh(runner: Any, drafts: tuple[Any, ...]) -> None:
    rank = _rank
    if rank is not None:
        for r in (runner, *drafts):
            rank.refresh_runner(r)


def _rebaseline(point: str) -> None:
    rank = _rank
    if rank is not None:
        got = rank.rebaseline(point)
        if got is not None:
            log.info("kvledger: %d bytes outside torch named %s", got, point)


def _guard(what: str, fn: Any, *args: Any) -> None:
    global _disabled
    try:
        fn(*args)
    except Exception as e:
        from allocator.errors import IncompatibleError

        if isinstance(e, IncompatibleError) or plugin_required():
            raise
        _disabled = f"{what} failed: {type(e).__name__}: {e}"
        log.warning("kvledger: %s; kvledger is off in this process (SGLang carries on)", _disabled)
