"""Is this vLLM one whose classes offer what kvledger reads? (vLLM 0.32, 0.33, 0.34.)

The version string alone is not trusted either way: a build whose classes lack what
kvledger reads is refused, and another version whose classes have all of it is accepted
with a warning. `check()` returns the one-line reason for refusing, or "".

Where the worker's KV cache is read is chosen by what the runner classes offer
(`worker_hooks()`), never by the version:

- the V1 runner's `initialize_kv_cache_tensors` (`vllm/v1/worker/gpu_model_runner.py`,
  0.32 and 0.33), which returns the layer views;
- the V2 runner's `initialize_kv_cache` (`vllm/v1/worker/gpu/model_runner.py`, the only
  GPU runner of 0.34), when it takes `kv_cache_config` and `is_profiling` and keeps the
  layer views in `kv_caches_by_layer` (0.32's V2 runner keeps none, so it is not hooked).
  Where it may hold an `ExtensibleKVCache` (0.34), that class must offer what
  `kvledger.engines.vllm.extensible` reads, else the V2 runner is not hooked.

Every runner that fits is hooked (a worker process builds one of them); a build where
none fits is refused.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any

from kvledger.engines.vllm.patch import MARK

log = logging.getLogger(__name__)

# The vLLM releases whose classes the tests run against (scripts/test-vllm).
TESTED: tuple[str, ...] = ("0.32", "0.33", "0.34")

# module -> (class, attributes it must have). Attributes of instances that only exist
# once built (a BlockPool's free queue) are checked where they are read.
CLASSES: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm.v1.core.sched.scheduler": (
        "Scheduler",
        ("__init__", "schedule", "has_requests", "shutdown"),
    ),
    "vllm.v1.core.block_pool": (
        "BlockPool",
        ("get_num_free_blocks", "free_blocks", "evict_blocks", "reset_prefix_cache"),
    ),
    "vllm.v1.core.kv_cache_utils": (
        "FreeKVCacheBlockQueue",
        ("append", "append_n", "prepend_n", "popleft", "popleft_n", "remove"),
    ),
}
FIELDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm.v1.kv_cache_interface": (
        "KVCacheConfig",
        ("num_blocks", "kv_cache_tensors", "kv_cache_groups"),
    ),
}
FUNCTIONS = (("vllm.v1.kv_cache_interface", "get_kv_cache_spec_kind"),)

V1_MODULE = "vllm.v1.worker.gpu_model_runner"
V2_MODULE = "vllm.v1.worker.gpu.model_runner"
EXTENSIBLE_MODULE = "vllm.v1.worker.extensible_kv_cache"
# What kvledger reads of an ExtensibleKVCache: attributes its __init__ sets ...
EXTENSIBLE_FIELDS = ("size", "capacity_blocks", "bytes_per_block", "buffer")
# ... and of its `buffer` (an ExtensibleTensor): the methods every mapping and unmapping
# goes through (kvledger wraps them) and the figures it reads.
TENSOR_MODULE = "vllm.utils.extensible_tensor"
TENSOR_METHODS = ("resize_segments_", "release_physical", "free")
TENSOR_PROPERTIES = ("capacity_bytes", "granularity", "physical_bytes", "num_bytes")


@dataclass(frozen=True)
class WorkerHook:
    """One runner method kvledger wraps to read the worker's KV cache."""

    name: str  # "v1" or "v2"
    module: str
    cls: type
    method: str

    @property
    def target(self) -> str:
        return f"{self.module}.{self.cls.__qualname__}.{self.method}"


def version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception as e:
        return f"unimportable ({type(e).__name__}: {e})"


def _class(module: str, name: str) -> tuple[Any, str]:
    """(the class, "") or (None, why it cannot be had)."""
    try:
        return getattr(importlib.import_module(module), name), ""
    except Exception as e:
        return None, f"{module}.{name} ({type(e).__name__})"


def _unwrapped(fn: Any) -> Any:
    return getattr(fn, MARK, fn)


def _code_names(fn: Any) -> set[str]:
    """Attribute and global names a function's code uses (`self.x = ...` puts `x` there)."""
    code = getattr(_unwrapped(fn), "__code__", None)
    return set(code.co_names) if code is not None else set()


def _v1(missing: list[str], module: str) -> WorkerHook | None:
    cls, why = _class(module, "GPUModelRunner")
    if cls is None:
        missing.append(why)
        return None
    if not callable(getattr(cls, "initialize_kv_cache_tensors", None)):
        missing.append("GPUModelRunner.initialize_kv_cache_tensors")
        return None
    return WorkerHook("v1", module, cls, "initialize_kv_cache_tensors")


def _v2(missing: list[str], module: str) -> WorkerHook | None:
    cls, why = _class(module, "GPUModelRunner")
    if cls is None:
        missing.append(why)
        return None
    fn = getattr(cls, "initialize_kv_cache", None)
    if not callable(fn):
        missing.append("V2 GPUModelRunner.initialize_kv_cache")
        return None
    lacks = []
    try:
        params = inspect.signature(_unwrapped(fn)).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    for p in ("kv_cache_config", "is_profiling"):
        if p not in params:
            lacks.append(f"V2 GPUModelRunner.initialize_kv_cache({p}=...)")
    names = _code_names(fn)
    for a in ("kv_caches_by_layer", "kv_cache_config"):
        if a not in names:
            lacks.append(f"V2 GPUModelRunner.{a} (set by initialize_kv_cache)")
    if "extensible_kv_cache" in names or "extensible" in params:
        lacks += extensible_missing()
    if lacks:
        missing.extend(lacks)
        return None
    return WorkerHook("v2", module, cls, "initialize_kv_cache")


def extensible_missing() -> list[str]:
    """What `kvledger.engines.vllm.extensible` reads and this vLLM's ExtensibleKVCache (or
    its ExtensibleTensor) lacks; [] when it has all of it."""
    cls, why = _class(EXTENSIBLE_MODULE, "ExtensibleKVCache")
    if cls is None:
        return [why]
    sets = _code_names(getattr(cls, "__init__", None))
    lacks = [f"ExtensibleKVCache.{a}" for a in EXTENSIBLE_FIELDS if a not in sets]
    tensor, why = _class(TENSOR_MODULE, "ExtensibleTensor")
    if tensor is None:
        return [*lacks, why]
    lacks += [
        f"ExtensibleTensor.{m}" for m in TENSOR_METHODS if not callable(getattr(tensor, m, None))
    ]
    lacks += [
        f"ExtensibleTensor.{p}"
        for p in TENSOR_PROPERTIES
        if not isinstance(getattr(tensor, p, None), property)
    ]
    return lacks


def worker_hooks(
    missing: list[str] | None = None, *, v1_module: str = V1_MODULE, v2_module: str = V2_MODULE
) -> list[WorkerHook]:
    """The runner methods that fit (V1 first); what each runner lacks goes into `missing`."""
    found: list[WorkerHook] = []
    why: list[str] = []
    for pick, module in ((_v1, v1_module), (_v2, v2_module)):
        hook = pick(why, module)
        if hook is not None:
            found.append(hook)
    if missing is not None:
        missing.extend(why)
    return found


def _missing(modules: set[str] | None = None) -> list[str]:
    missing = []
    for table, fields in ((CLASSES, False), (FIELDS, True)):
        for module, (cls_name, attrs) in table.items():
            if modules is not None and module not in modules:
                continue
            cls, why = _class(module, cls_name)
            if cls is None:
                missing.append(why)
                continue
            have = set(getattr(cls, "__dataclass_fields__", {})) if fields else set(dir(cls))
            missing += [f"{cls_name}.{a}" for a in attrs if a not in have]
    for module, name in FUNCTIONS:
        if modules is not None and module not in modules:
            continue
        try:
            getattr(importlib.import_module(module), name)
        except Exception:
            missing.append(f"{module}.{name}")
    return missing


def _runner_missing(modules: set[str] | None) -> list[str]:
    """[] when some runner fits, else one entry naming what both lack."""
    if modules is not None and not modules & {V1_MODULE, V2_MODULE}:
        return []
    why: list[str] = []
    if worker_hooks(why):
        return []
    return [
        "a worker hook: neither the V1 runner's initialize_kv_cache_tensors nor the V2 "
        f"runner's initialize_kv_cache fits ({', '.join(why)})"
    ]


def tested(got: str) -> bool:
    return any(got.startswith(v + ".") for v in TESTED)


def check(modules: set[str] | None = None) -> str:
    """ "" when kvledger can read this vLLM (only `modules`' classes, if given), else the
    one-line reason it cannot."""
    got = version()
    missing = _missing(modules) + _runner_missing(modules)
    if missing:
        return (
            f"vLLM {got}: kvledger reads the KV classes of vLLM {', '.join(TESTED)} and this "
            f"build lacks {', '.join(missing)}; kvledger is off"
        )
    if not tested(got):
        log.warning(
            "kvledger: vLLM %s is none of %s, but its classes have everything kvledger "
            "reads; carrying on",
            got,
            ", ".join(TESTED),
        )
    return ""
