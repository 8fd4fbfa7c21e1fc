"""kvledger's patches on vLLM 0.32 to 0.34 (vLLM has no hook registry: `MethodPatch` sets them).

| target | when | what kvledger does |
|---|---|---|
| `vllm.v1.worker.gpu_model_runner.GPUModelRunner.initialize_kv_cache_tensors` (V1 runner, 0.32/0.33) | after | registers the worker's KV cache (`groups.register_worker_cache`): storage once, one account per group; the first one starts the worker's publisher |
| `vllm.v1.worker.gpu.model_runner.GPUModelRunner.initialize_kv_cache` (V2 runner, 0.34) | after, unless `is_profiling` | the same, from `kv_caches_by_layer`, `kv_cache_config` and `extensible_kv_cache` |
| `vllm.utils.extensible_tensor.ExtensibleTensor.resize_segments_`, `release_physical`, `free` (0.34) | after | on the buffer of a registered extensible KV cache: its committed granules and blocks (`extensible.CommitFollower`); after `free`, the worker's file is closed |
| `vllm.v1.worker.gpu_worker.Worker.compile_or_warm_up_model` (where the worker class does not override it) | after | a worker on CUDA: names the memory warm-up and CUDA graph capture took outside torch (`gpu_truth.WorkerTruth.rebaseline`) |
| `vllm.v1.core.sched.scheduler.Scheduler.__init__` | after | registers the scheduler's block pool (`occupancy.SchedulerOccupancy`); starts the engine core's publisher |
| `vllm.v1.core.sched.scheduler.Scheduler.schedule` | after | when a publish is due (O(1) check), refreshes the occupancy on the scheduler's own thread and publishes; marks the figures as changed (one attribute) |
| `vllm.v1.core.sched.scheduler.Scheduler.has_requests` | after | when it answers False (the engine core is about to go idle: vLLM stops calling `schedule`), refreshes and publishes at once if a step ran since the last refresh, else when a publish is due: the figures reach the idle truth without waiting for another request |
| `vllm.v1.core.sched.scheduler.Scheduler.shutdown` | after | the engine core's file is removed |

An `atexit` handler closes each process's ledger too. Every wrapper catches kvledger's
own failure, logs one line and turns kvledger off in that process (vLLM carries on),
unless `KVLEDGER_VLLM_REQUIRE=1`.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any

from kvledger.engines.vllm.patch import MethodPatch
from kvledger.engines.vllm.switches import ENV_COST, ENV_REQUIRE, env_switch

log = logging.getLogger(__name__)

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"  # V1 (0.32, 0.33)
RUNNER_V2_MODULE = "vllm.v1.worker.gpu.model_runner"  # V2 (0.34; 0.33's if it fits)
WORKER_MODULE = "vllm.v1.worker.gpu_worker"
SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"

_lock = threading.RLock()
_patches: list[MethodPatch] = []
_worker: Any = None  # this process's worker ProcessLedger
_scheduler: Any = None  # this process's engine-core ProcessLedger
_disabled = ""
_atexit = False


def install() -> list[MethodPatch]:
    """Patch vLLM (once per process; a second call changes nothing). A vLLM whose classes
    do not match what kvledger reads is refused with one log line (raised with
    KVLEDGER_VLLM_REQUIRE=1)."""
    global _atexit
    with _lock:
        if _patches:
            return list(_patches)
        from kvledger.engines.vllm.compat import check

        why = check()
        if why:
            if _require():
                raise RuntimeError(why)
            log.warning("kvledger: %s", why)
            return []
        import importlib

        scheduler = importlib.import_module(SCHEDULER_MODULE).Scheduler
        made = [
            *_worker_patches(),
            MethodPatch(scheduler, "__init__", _wrap_scheduler_init),
            MethodPatch(scheduler, "schedule", _wrap_schedule),
            MethodPatch(scheduler, "has_requests", _wrap_has_requests),
            MethodPatch(scheduler, "shutdown", _wrap_shutdown),
        ]
        if env_switch(ENV_COST):  # opt-in self-measurement (cost.py); off: this check only
            from kvledger.engines.vllm.cost import instrument

            made = instrument(made)
        for p in made:
            p.apply()
        _patches.extend(made)
        if not _atexit:
            atexit.register(shutdown)
            _atexit = True
        return list(made)


def uninstall() -> None:
    """Close this process's ledgers and put vLLM's methods back (tests; idempotent)."""
    global _disabled
    shutdown()
    with _lock:
        while _patches:
            _patches.pop().remove()
        _disabled = ""


def shutdown() -> None:
    """Close this process's ledgers (publishers stopped, files removed). Idempotent."""
    global _worker, _scheduler
    with _lock:
        parts, _worker, _scheduler = [_worker, _scheduler], None, None
    for p in parts:
        if p is not None:
            p.close()


def worker_ledger() -> Any:
    return _worker


def scheduler_ledger() -> Any:
    return _scheduler


def _worker_patches() -> list[MethodPatch]:
    """The worker's hooks, chosen by what vLLM's runner classes offer (compat.worker_hooks);
    with the V2 runner, ExtensibleTensor's methods where vLLM has the extensible cache."""
    from kvledger.engines.vllm.compat import worker_hooks

    made = _warmup_patches()
    for hook in worker_hooks(v1_module=RUNNER_MODULE, v2_module=RUNNER_V2_MODULE):
        if hook.name == "v1":
            made.append(MethodPatch(hook.cls, hook.method, _wrap_kv_tensors))
            continue
        made.append(MethodPatch(hook.cls, hook.method, _wrap_kv_cache))
        from kvledger.engines.vllm.compat import extensible_missing

        if not extensible_missing():
            from kvledger.engines.vllm.extensible import tensor_patches

            made += tensor_patches(_guard, _worker_cache_freed)
    return made


def _warmup_patches() -> list[MethodPatch]:
    """The re-baseline after warm-up, where vLLM's GPU worker has the method (it is optional:
    without it the GPU breakdown still reads, with warm-up's memory unattributed)."""
    import importlib

    try:
        worker = importlib.import_module(WORKER_MODULE).Worker
    except Exception as e:
        log.info("kvledger: no GPU worker class to re-baseline after warm-up (%s)", e)
        return []
    if not callable(getattr(worker, "compile_or_warm_up_model", None)):
        return []
    return [MethodPatch(worker, "compile_or_warm_up_model", _wrap_warm_up)]


# -- wrappers ---------------------------------------------------------------------------
def _wrap_warm_up(original: Any) -> Any:
    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        _guard("naming the memory warm-up took", _rebaseline_worker, "after warm-up")
        return out

    return compile_or_warm_up_model


def _wrap_kv_cache(original: Any) -> Any:
    import inspect

    signature = inspect.signature(original)  # where is_profiling is (compat checked it is)

    def initialize_kv_cache(self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, kv_cache_config, *args, **kwargs)
        bound = signature.bind(self, kv_cache_config, *args, **kwargs).arguments
        # The profiling run's minimal cache is dropped before the real one: not registered.
        if not bound.get("is_profiling", False):
            _guard(
                "registering the worker's KV cache",
                _add_worker_cache,
                self,
                self.kv_cache_config,  # as allocated (vLLM's deep copy, padded when extensible)
                getattr(self, "kv_caches_by_layer", None),
                getattr(self, "extensible_kv_cache", None),
            )
        return out

    return initialize_kv_cache


def _wrap_kv_tensors(original: Any) -> Any:
    def initialize_kv_cache_tensors(
        self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any
    ) -> Any:
        kv_caches = original(self, kv_cache_config, *args, **kwargs)
        _guard(
            "registering the worker's KV cache", _add_worker_cache, self, kv_cache_config, kv_caches
        )
        return kv_caches

    return initialize_kv_cache_tensors


def _wrap_scheduler_init(original: Any) -> Any:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _guard("registering the scheduler's block pool", _add_scheduler, self)

    return __init__


def _wrap_schedule(original: Any) -> Any:
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        ledger = _scheduler
        occ = getattr(self, "_kvledger_occupancy", None)
        if ledger is not None and occ is not None:
            occ.dirty = True  # update_from_output frees blocks after this: refresh at idle
            _guard("publishing the scheduler's occupancy", ledger.publish_if_due, occ.refresh)
        return out

    return schedule


def _wrap_has_requests(original: Any) -> Any:
    def has_requests(self: Any, *args: Any, **kwargs: Any) -> Any:
        busy = original(self, *args, **kwargs)
        if not busy:
            ledger = _scheduler
            occ = getattr(self, "_kvledger_occupancy", None)
            if ledger is not None and occ is not None:
                _guard("publishing the idle scheduler's occupancy", _publish_idle, ledger, occ)
        return busy

    return has_requests


def _publish_idle(ledger: Any, occ: Any) -> None:
    """The engine core has nothing to schedule: vLLM calls `schedule` no more until a request
    comes, so the last step's frees are published now (once), not at the next step."""
    if occ.dirty:
        occ.dirty = False
        ledger.publish_now(occ.refresh)
    else:
        ledger.publish_if_due(occ.refresh)


def _wrap_shutdown(original: Any) -> Any:
    def shutdown_(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            _guard("closing at scheduler shutdown", _close_scheduler, self)

    return shutdown_


# -- what they do -------------------------------------------------------------------------
def _kind_of(spec: Any) -> str:
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

    return str(get_kv_cache_spec_kind(spec).value)


def _new_ledger(labels: dict[str, str]) -> Any:
    from kvledger.engines.vllm.process import ProcessLedger, publish_interval, snapshot_dir

    return ProcessLedger(labels, directory=snapshot_dir(), interval=publish_interval())


def _add_worker_cache(
    runner: Any, kv_cache_config: Any, kv_caches: Any, extensible: Any = None
) -> None:
    global _worker
    if _disabled or not kv_caches:
        return
    from kvledger.engines.vllm.groups import register_worker_cache
    from kvledger.engines.vllm.labels import worker_labels, worker_ranks

    with _lock:
        if _worker is not None:
            # The runner rebuilt its KV cache (a re-initialisation): the old one is gone.
            old, _worker = _worker, None
            old.close()
        tp, pp = worker_ranks()
        ledger = _new_ledger(worker_labels(runner.vllm_config, tp, pp))
        try:
            ledger.add(
                register_worker_cache(
                    ledger.ledger,
                    kv_cache_config,
                    kv_caches,
                    kind_of=_kind_of,
                    extensible=extensible,
                )
            )
            _add_gpu_truth(ledger, runner, kv_caches)
        except BaseException:
            ledger.close()
            raise
        _worker = ledger
    log.info("kvledger: worker KV cache published to %s", ledger.publisher.path)


def _add_gpu_truth(ledger: Any, runner: Any, kv_caches: Any) -> None:
    """NVML truth and the GPU breakdown for a worker whose cache is on CUDA (gpu_truth)."""
    from kvledger.engines.vllm.gpu_truth import WorkerTruth, cuda_index

    index = cuda_index(kv_caches)
    if index is None:
        return
    try:
        truth = WorkerTruth(ledger.ledger, runner, index)
    except Exception as e:  # the KV figures stand without it
        if _require():
            raise
        log.warning(
            "kvledger: no GPU breakdown for this worker (cuda:%d): %s: %s",
            index,
            type(e).__name__,
            e,
        )
        return
    ledger.add(truth)


def _rebaseline_worker(point: str) -> None:
    from kvledger.engines.vllm.gpu_truth import WorkerTruth

    ledger = _worker
    if ledger is None:
        return
    for part in list(ledger.parts):
        if isinstance(part, WorkerTruth):
            part.rebaseline(point)
            ledger.publish_now()


def _worker_cache_freed(follower: Any) -> None:
    """vLLM freed the extensible KV cache `follower` follows (its runner shut down): the
    worker's file goes, as its accounts would describe memory that is gone."""
    global _worker
    with _lock:
        ledger = _worker
        parts = ledger.parts if ledger is not None else []
        if not any(getattr(p, "follower", None) is follower for p in parts):
            return
        _worker = None
    ledger.close()


def _add_scheduler(scheduler: Any) -> None:
    global _scheduler
    if _disabled:
        return
    from kvledger.engines.vllm.labels import scheduler_labels
    from kvledger.engines.vllm.occupancy import SchedulerOccupancy

    with _lock:
        if _scheduler is not None:
            old, _scheduler = _scheduler, None
            old.close()
        ledger = _new_ledger(scheduler_labels(scheduler.vllm_config))
        try:
            occ = SchedulerOccupancy(
                ledger.ledger,
                scheduler.kv_cache_manager,
                kind_of=_kind_of,
                running=lambda: scheduler.running,  # footprints, read at each refresh
            )
            ledger.add(occ)
        except BaseException:
            ledger.close()
            raise
        scheduler._kvledger_occupancy = occ
        _scheduler = ledger
    log.info("kvledger: scheduler occupancy published to %s", ledger.publisher.path)


def _close_scheduler(scheduler: Any) -> None:
    global _scheduler
    with _lock:
        ledger = _scheduler
        if ledger is None or getattr(scheduler, "_kvledger_occupancy", None) not in ledger.parts:
            return
        _scheduler = None
    scheduler._kvledger_occupancy = None
    ledger.close()


def _guard(what: str, fn: Any, *args: Any) -> None:
    global _disabled
    try:
        fn(*args)
    except Exception as e:
        if _require():
            raise
        _disabled = f"{what} failed: {type(e).__name__}: {e}"
        log.warning("kvledger: %s; kvledger is off in this process (vLLM carries on)", _disabled)
        shutdown()


def _require() -> bool:
    try:
        return env_switch(ENV_REQUIRE)
    except ValueError:
        return True  # a malformed require switch is not a "no"
