"""SGLang's own KV figure fixed in place (marker `sglang`): with the plugin's rank on a real
SGLang 0.5.23 DeepSeek-V4 pool (CPU), the pool's `mem_usage` -- which SGLang reads for
`sglang:kv_cache_memory_usage_gb`, `/get_server_info` and `/v1/loads` -- carries the
physical bytes kvledger accounts, in SGLang's GB; `KVLEDGER_SGLANG_NATIVE_MEM_USAGE=1`
leaves SGLang's own 0; closing the rank puts SGLang's value back."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvledger.engines.sglang.plugin.rank import RankLedger
from kvledger.engines.sglang.switches import NATIVE_MEM_USAGE
from tests.kvledger.engines.sglang import rig

pytestmark = pytest.mark.sglang

LABELS = {"model_name": "m", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
GB = 1 << 30
READ = "token_to_kv_pool_allocator.get_kvcache().mem_usage"


class NS(SimpleNamespace):
    pass


def _server_info_kvcache(allocator) -> float:
    """What SGLang's /get_server_info reports as `memory_usage.kvcache`, through its own
    `SchedulerInternalStateController._add_memory_usage`."""
    from sglang.srt.managers.scheduler_components.internal_state import (
        SchedulerInternalStateController,
    )

    ctl = object.__new__(SchedulerInternalStateController)
    ctl.scheduler = NS(
        draft_worker=None,
        tp_worker=NS(model_runner=NS(weight_load_mem_usage=1.0), graph_memory_usage={}),
        token_to_kv_pool_allocator=allocator,
        startup_available_gpu_memory_gb=10.0,
        max_total_num_tokens=1,
        swa_tokens_per_layer=None,
    )
    state: dict = {}
    ctl._add_memory_usage(state)
    return state["memory_usage"]["kvcache"]


def test_sglang_reads_mem_usage_where_kvledger_writes_it() -> None:
    from sglang.srt.managers import scheduler
    from sglang.srt.managers.scheduler_components import internal_state, load_inquirer

    for module in (scheduler, internal_state, load_inquirer):
        assert READ in " ".join(inspect.getsource(module).split()), module.__name__


@pytest.mark.parametrize("native", [False, True])
def test_dsv4_mem_usage_carries_kvledgers_kv_bytes(tmp_path: Path, native: bool) -> None:
    with rig.published():
        pool = rig.make_pool()
        allocator = rig.make_allocator(pool, rig.make_req_to_token())
        assert allocator.get_kvcache() is pool
        assert pool.mem_usage == 0  # SGLang's own figure for DeepSeek-V4 (issue #37852)
        env = {NATIVE_MEM_USAGE: "1"} if native else {}
        rank = RankLedger(LABELS, directory=str(tmp_path), interval=60, mem_usage_env=env)
        runner = NS(
            token_to_kv_pool=pool,
            token_to_kv_pool_allocator=allocator,
            model=torch.nn.Linear(4, 4),
        )
        with rank:
            rank.add_runner(runner)
            physical = rank.ledger.snapshot().total("physical_bytes")
            assert physical > 4 * (1 << 20)
            if native:
                assert pool.mem_usage == 0 and _server_info_kvcache(allocator) == 0
                return
            assert pool.mem_usage == physical / GB
            assert _server_info_kvcache(allocator) == round(physical / GB, 3) > 0
            # the figure follows each publish
            assert rank.publisher is not None
            rank.publisher.publish()
            assert pool.mem_usage == rank.ledger.snapshot().total("physical_bytes") / GB
        assert pool.mem_usage == 0  # closed with its pools released: SGLang's own value back
