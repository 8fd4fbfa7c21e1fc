"""An SGLang scheduler process's start-up, up to its KV pools, with kvledger loaded by SGLang.

    python -m tests.kvledger.engines.sglang.plugin.scheduler_proc [--build] [--device cpu|cuda]

Run in a process of its own (the hooks patch SGLang's classes for the whole process),
with the environment the test chooses (KVLEDGER_SGLANG, KVLEDGER_SNAPSHOT_DIR, ...).
What is SGLang's own: `load_plugins()` (entry-point discovery and HookRegistry), the
runtime context a scheduler publishes (served model name, ranks), the DeepSeek-V4 pool,
`ReqToTokenPool`, `SWATokenToKVPoolAllocator` and its alloc/free paths, and the hooked
methods `ModelRunner._init_post_memory_pool_components` and
`Scheduler.release_host_resources`, called on minimal runner/scheduler objects carrying
the attributes those methods read (a full ModelRunner needs a model and a device).

Prints one JSON line on start, then one per command read from stdin:
`prefill N` (a request of N tokens through SGLang's allocator), `finish` (free every
request), `publish`, `warm [N ...]` (what a server does before serving: requests of N
tokens through the allocator and their release, so its kernels for those shapes are loaded,
and on CUDA a CUDA graph capture, then the plugin's
after-capture hook: SGLang's own `init_cuda_graphs` needs a model, so the hook is called
directly), `exit` (SGLang's graceful scheduler exit path), `quit` (return normally: atexit
runs), `kill` (SIGKILL itself). Each answer carries the ledger's totals and reconciliation.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import types
from typing import Any

SERVED_MODEL = "kvl-plugin-test"


def reply(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def kvledger_hooks() -> list[str]:
    from sglang.srt.plugins.hook_registry import HookRegistry

    return sorted(
        t
        for t, hooks in HookRegistry._hooks.items()
        if any(src is not None and src.plugin_name == "kvledger" for _, _, src in hooks)
    )


def applied() -> dict[str, list[str]]:
    """kvledger's targets HookRegistry marked patched, and those whose attribute is now
    SGLang's wrapper (it sets `__wrapped__` to the original)."""
    import pkgutil

    from sglang.srt.plugins.hook_registry import HookRegistry

    mine = kvledger_hooks()
    wrapped = []
    for target in mine:
        owner, attr = target.rsplit(".", 1)
        if getattr(getattr(pkgutil.resolve_name(owner), attr), "__wrapped__", None) is not None:
            wrapped.append(target)
    return {"patched": [t for t in mine if t in HookRegistry._patched], "wrapped": wrapped}


def minimal_runner(pool: Any, allocator: Any, r2t: Any, device: str) -> Any:
    """A ModelRunner (no __init__: no model, no distributed groups) with what
    `_init_post_memory_pool_components` reads, as `alloc_memory_pool` leaves it."""
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.runtime_context import get_server_args

    from kvledger.demo.source import default_config_path

    with open(default_config_path()) as f:
        hf = types.SimpleNamespace(**json.load(f))
    mr = ModelRunner.__new__(ModelRunner)
    mr.server_args = get_server_args()
    mr.token_to_kv_pool = pool
    mr.token_to_kv_pool_allocator = allocator
    mr.req_to_token_pool = r2t
    mr.is_draft_worker = False
    mr.page_size = allocator.page_size
    mr.device = device
    mr.model = None
    mr.model_config = types.SimpleNamespace(
        use_ngram_embedding=False,
        use_engram=False,
        ngram_embedding_n=0,
        vocab_size=hf.vocab_size,
        hf_text_config=hf,
    )
    mr.max_running_requests = 4
    mr.max_total_num_tokens = allocator.size
    mr.enable_hisparse = False
    mr.is_hybrid_swa = False
    mr._token_oracle_manager = None
    return mr


def minimal_scheduler() -> Any:
    """A Scheduler (no __init__) with what `release_host_resources` reads."""
    from sglang.srt.managers.scheduler import Scheduler

    s = Scheduler.__new__(Scheduler)
    s.hisparse_coordinator = None
    s.tree_cache = types.SimpleNamespace(release_host_resources=lambda: None)
    s.decode_offload_manager = None
    s.enable_overlap = False  # the normal loop: compaction may run (server_hooks)
    return s


def storages(pool: Any) -> int:
    """Bytes of every tensor storage reachable from the pool (independent of kvledger)."""
    from tests.kvledger.engines.sglang.rig import unique_storages

    return sum(unique_storages(pool).values())


def capture_a_graph(device: str) -> None:
    """A real CUDA graph capture and replay (what `init_cuda_graphs` does per batch size)."""
    import torch

    x = torch.ones(1 << 20, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        (x * 2).sum()  # warm-up outside the capture, as CUDA graph runners do
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = (x * 2).sum()
    graph.replay()
    torch.cuda.synchronize(device)
    assert float(y) == 2.0 * (1 << 20)
    _keep.append((graph, x, y))  # a server keeps its graphs


_keep: list[Any] = []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--swa-pages", type=int, default=8, help="SGLang pages of 256 tokens")
    ap.add_argument("--full-pages", type=int, default=20)
    ap.add_argument("--pool", choices=("dsv4", "mla", "mha"), default="dsv4")
    args = ap.parse_args()

    from sglang.srt.plugins import load_plugins

    load_plugins()  # SGLang's own loader, as run_scheduler_process calls it first
    mods = sorted(m for m in sys.modules if m.startswith(("kvledger", "accounting", "allocator")))
    if not args.build:
        reply(hooks=kvledger_hooks(), modules=mods, **applied())
        return

    from sglang.srt.model_executor.model_runner import ModelRunner

    from kvledger.engines.sglang.plugin import server_hooks as hooks
    from tests.kvledger.engines.sglang import rig
    from tests.kvledger.engines.sglang.plugin import device_rig
    from tests.kvledger.engines.sglang.sglang_reference import published

    with published(page_size=rig.PAGE, swa_full_tokens_ratio=0.1, served_model_name=SERVED_MODEL):
        if args.pool == "dsv4":
            pool, r2t, alloc = device_rig.build(
                args.device, swa_pages=args.swa_pages, full_pages=args.full_pages
            )
        else:
            pool, r2t, alloc = device_rig.build_plain(args.pool, args.device)
        runner = minimal_runner(pool, alloc, r2t, args.device)
        ModelRunner._init_post_memory_pool_components(runner)  # the hooked method, for real
        rank = hooks.current()
        path = rank.publisher.path if rank is not None and rank.publisher else None
        record = next(iter(rank.pools.values())) if rank is not None else None
        reply(
            hooks=kvledger_hooks(),
            file=path,
            labels=rank.ledger.labels if rank is not None else None,
            bridged=bool(record and record.bridged),
            reason=record.bridge.reason if record and record.bridge else "",
            storages=storages(pool),
            pool=record.name if record else None,
            index_translator=type(getattr(runner, "kv_index_translator", None)).__name__,
        )
        sched = device_rig.Requests(alloc, r2t, args.device)
        for line in sys.stdin:
            cmd, *rest = line.split()
            if cmd == "prefill":
                sched.prefill(int(rest[0]))
            elif cmd == "finish":
                sched.finish_all()
            elif cmd == "finish_every_other":
                sched.finish_every_other()
            elif cmd == "idle":
                # SGLang's own on_idle needs a running server's state: the plugin's AFTER hook
                # is called directly, on a scheduler of the normal loop, as HookRegistry would.
                if record is not None and record.bridge is not None and record.bridged:
                    record.bridge.wait_idle()
                hooks.on_idle(None, minimal_scheduler())
            elif cmd == "exit":
                minimal_scheduler().release_host_resources()  # the hooked method, for real
                reply(file_exists=bool(path and os.path.exists(path)), rank=hooks.current() is None)
                continue
            elif cmd == "warm":
                for n in rest or [str(rig.PAGE)]:
                    sched.prefill(int(n))
                sched.finish_all()
                if args.device.startswith("cuda"):
                    capture_a_graph(args.device)
                hooks.on_graphs_captured(None, runner)
            elif cmd == "quit":
                return
            elif cmd == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if record is not None and record.bridge is not None and record.bridged:
                # No map in flight when the truth is read: the host memfd's blocks then equal
                # the ledger's physical bytes to the byte (mapping ahead runs in the background).
                record.bridge.wait_idle()
            if rank is not None and rank.publisher is not None:
                snap = rank.publisher.publish()
                totals = {
                    f: snap.total(f) for f in ("tensor_bytes", "physical_bytes", "occupied_slots")
                }
                recon = [dict(r) for r in snap.reconciliation]
            else:
                totals, recon = {}, []
            swa = getattr(alloc, "swa_attn_allocator", None)
            compaction: dict[str, Any] = {}
            if rank is not None and record is not None and record.bridged:
                compaction = {
                    **rank.compaction.stats(),
                    "excess_pages": rank.compaction.excess(record.bridge),
                    "rows_moved": int(record.bridge.rows_moved),
                }
            reply(
                compaction=compaction,
                swa_free_pages=int(swa.available_size()) // rig.PAGE if swa else None,
                swa_pages=int(alloc.size_swa) // rig.PAGE if swa else None,
                totals=totals,
                reconciliation=recon,
                # what SGLang reads for its own KV figure (kvledger.engines.sglang.mem_usage)
                mem_usage=float(alloc.get_kvcache().mem_usage),
            )


if __name__ == "__main__":
    main()
