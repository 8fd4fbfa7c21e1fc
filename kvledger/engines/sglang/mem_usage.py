"""SGLang's own KV figure, `mem_usage`, set to kvledger's.

SGLang 0.5.23 reads `token_to_kv_pool_allocator.get_kvcache().mem_usage` (a float in
GB, bytes / 2^30: `GB = 1024 * 1024 * 1024` in `sglang/srt/mem_cache/memory_pool.py`)
for its `sglang:kv_cache_memory_usage_gb` gauge (`Scheduler.emit_metrics_constants`,
once at start-up), `/get_server_info` (`internal_state._add_memory_usage`) and
`/v1/loads` (`load_inquirer`). The DeepSeek-V4 pool never sets it, so all three read 0
(SGLang issue #37852); a post-capture pool sets it to its virtual extent, not the
memory behind it. With the plugin on, the rank writes the physical bytes kvledger
accounts for the pool into it after every publish (`RankLedger`); closing the rank
with its pools released puts SGLang's own value back.

    KVLEDGER_SGLANG_NATIVE_MEM_USAGE=1   leave `mem_usage` as SGLang computes it
                                         (kvledger.engines.sglang.switches)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvledger.engines.sglang.switches import mem_usage_fixed

GB = 1 << 30  # SGLang's unit for mem_usage


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether kvledger writes `mem_usage` (kvledger.engines.sglang.switches.mem_usage_fixed)."""
    return mem_usage_fixed(env)


def write(pool: Any, physical_bytes: int) -> None:
    """`pool.mem_usage` = `physical_bytes` in SGLang's unit."""
    pool.mem_usage = physical_bytes / GB
