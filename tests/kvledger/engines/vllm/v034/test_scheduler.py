"""The engine core's side on vLLM 0.34's own classes: the occupancy tests of the 0.33 tier
(`tests/kvledger/engines/vllm/test_occupancy.py`, the same code) on a real 0.34
`KVCacheManager`, `BlockPool` and `FreeKVCacheBlockQueue`: allocate, prefix hit, free,
eviction on reuse, `evict_blocks`, `reset_prefix_cache`, the ledger's figures compared with
a walk over the pool at every step, and the holders read through `_insert_block_hash` /
`_remove_cached_block_hashes`, and the per-request footprints read from each group manager's
`req_to_blocks`."""

from __future__ import annotations

import pytest

from tests.kvledger.engines.vllm import test_occupancy as occupancy
from tests.kvledger.engines.vllm.v034 import runner_v2

pytestmark = pytest.mark.vllm034


@pytest.fixture(scope="module")
def cfg():
    return runner_v2.vllm_config()


test_figures_follow_the_pool = occupancy.test_figures_follow_the_pool
test_without_prefix_caching_nothing_is_wrapped = (
    occupancy.test_without_prefix_caching_nothing_is_wrapped
)
TestFootprints = occupancy.TestFootprints
TestPublishedFootprints = occupancy.TestPublishedFootprints
