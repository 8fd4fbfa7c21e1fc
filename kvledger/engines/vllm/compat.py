"""Is this vLLM one whose classes match what kvledger reads? (vLLM 0.33.)

The version string alone is not trusted either way: a 0.33 build whose classes lack
what kvledger reads is refused, and another version whose classes have all of it is
accepted with a warning. `check()` returns the one-line reason for refusing, or "".
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

log = logging.getLogger(__name__)

TESTED = "0.33"

# module -> (class, attributes it must have). Attributes of instances that only exist
# once built (a BlockPool's free queue) are checked where they are read.
CLASSES: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm.v1.worker.gpu_model_runner": ("GPUModelRunner", ("initialize_kv_cache_tensors",)),
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


def version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception as e:
        return f"unimportable ({type(e).__name__}: {e})"


def _missing(modules: set[str] | None = None) -> list[str]:
    missing = []
    for table, fields in ((CLASSES, False), (FIELDS, True)):
        for module, (cls_name, attrs) in table.items():
            if modules is not None and module not in modules:
                continue
            try:
                cls: Any = getattr(importlib.import_module(module), cls_name)
            except Exception as e:
                missing.append(f"{module}.{cls_name} ({type(e).__name__})")
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


def check(modules: set[str] | None = None) -> str:
    """ "" when kvledger can read this vLLM (only `modules`' classes, if given), else the
    one-line reason it cannot."""
    got = version()
    missing = _missing(modules)
    if missing:
        return (
            f"vLLM {got}: kvledger reads vLLM {TESTED}'s KV classes and this build lacks "
            f"{', '.join(missing)}; kvledger is off"
        )
    if not got.startswith(TESTED + "."):
        log.warning(
            "kvledger: vLLM %s is not %s, but its classes have everything kvledger reads; "
            "carrying on",
            got,
            TESTED,
        )
    return ""
