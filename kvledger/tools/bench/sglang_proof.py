"""The no-synchronisation proof of the serving loop (`python -m
kvledger.tools.bench.sglang_serving proof [--device cuda]`): every path of SGLang's allocator
(alloc, decode, window eviction, free, compaction, detach), native (the control) and bridged,
run on the scheduler's stream with a forward in flight on the forward stream
(`sglang_forward`). On CUDA under `torch.cuda.set_sync_debug_mode('error')`, with
`Event`/`Stream.synchronize` refused on the scheduler thread too; on the host the waits
`sglang_waits.ModelReader` counted.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from kvledger.engines.sglang.bridge.compact_policy import CompactionPolicy
from kvledger.tools.bench.sglang_engine import Request, Shape, attach_bridge, published
from kvledger.tools.bench.sglang_forward import CudaDevice, HostDevice
from kvledger.tools.bench.sglang_loop import ServingEngine
from kvledger.tools.bench.sglang_waits import WaitLog, model_reader, synchronize_wrapped

IDLE_STEPS = 500  # compaction steps the proof's idle loop takes at most
IDLE_STEP_S = 0.001  # between them (SGLang's idle loop sleeps between its polls too)
PROOF_PATHS = ("alloc", "decode", "window eviction", "free", "compaction", "detach")
# Detach unmaps every page, so it waits for all device work queued before it (the unmap
# rule); it runs once, when a rank closes with its pools released, never in a serving step.
WAITS_BY_DESIGN = ("detach",)


class _NotApplicable(Exception):
    pass


@contextlib.contextmanager
def _strict(cuda: bool, log: WaitLog) -> Iterator[None]:
    """CUDA: torch's sync debug mode 'error' and `Event`/`Stream.synchronize` raising too (the
    debug mode does not see them), on `log.owner`'s thread. The debug mode is process-wide:
    the background mapper's fence waits raise too while a path runs (the mapper logs and
    retries them; nothing of the path's result depends on it). Host: nothing (the waits go to
    `log`)."""
    if not cuda:
        yield
        return
    import torch

    def refuse(name: str, fn: Callable[[Any], None]) -> Callable[[Any], None]:
        def wrapper(self: Any) -> None:
            if threading.get_ident() == log.owner:
                raise RuntimeError(f"torch.cuda.{name}.synchronize on the scheduler thread")
            fn(self)

        return wrapper

    with synchronize_wrapped(refuse):
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)


def _proof_one(name: str, shape: Shape, device: str, dev: Any, forward_ms: float) -> dict[str, str]:
    """The proof's paths on one engine (`name`: native or bridged)."""
    import torch

    from accounting.ledger import Ledger

    cuda = device.startswith("cuda")
    e = ServingEngine(shape, device)
    log = WaitLog()
    log.owner = threading.get_ident()
    bridge = None
    if name == "bridged":
        bridge = attach_bridge(e, Ledger({}))
        if not cuda:
            model_reader(bridge, dev, log)
    reqs: list[Request] = []
    policy = CompactionPolicy()
    res: dict[str, str] = {}
    failed = False

    def admit() -> None:
        for _ in range(120):
            r = e.admit(200)
            assert r is not None
            reqs.append(r)

    def decode() -> None:
        for _ in range(3):
            e.decode_some(reqs)

    def evict() -> None:
        for r in reqs:
            r.seq_len += 0
        e.evict_windows(reqs)

    def free() -> None:
        for r in reqs[::3] + reqs[1::3]:
            e.release(r)
        del reqs[:]

    def compaction() -> None:
        # As the plugin calls it from SGLang's idle loop: step after step until one moves
        # rows. A step whose journal holds ids still being read (the free path's, read
        # behind the forward) moves nothing and waits for nothing: a later one compacts.
        if bridge is None:
            raise _NotApplicable
        for _ in range(IDLE_STEPS):
            if policy.step(bridge):
                return
            time.sleep(IDLE_STEP_S)
        raise RuntimeError(
            f"compaction: no row moved in {IDLE_STEPS} idle steps (not due, or deferred each time)"
        )

    def detach() -> None:
        if bridge is None:
            raise _NotApplicable
        bridge.detach()

    paths = dict(zip(PROOF_PATHS, (admit, decode, evict, free, compaction, detach), strict=True))
    for path, fn in paths.items():
        if cuda:
            torch.cuda.synchronize()
        elif bridge is not None:
            bridge.wait_idle()
        # the forward in flight (host: until the path is done, or waited for)
        dev.launch(forward_ms / 1000 if cuda else None)
        w0 = log.waits
        # The page store counts a fence wait that fails (and goes on to its drain, which
        # waits through the driver, unseen by torch's debug mode): a refused wait there is
        # a wait all the same, and the path says so rather than "ok".
        fails = bridge.store.reporter.failures if bridge is not None else None
        s0 = fails.by_op.get("synchronize", 0) if fails is not None else 0
        try:
            with _strict(cuda, log):
                fn()
            refused = (fails.by_op.get("synchronize", 0) if fails is not None else 0) - s0
            if refused:
                got = f"waits: {refused} fence wait(s) refused, counted by the store"
            elif log.waits == w0:
                got = "ok"
            else:
                got = f"{log.waits - w0} waits ({dict(log.kinds)})"
        except _NotApplicable:
            got = "n/a"
        except Exception as ex:
            got = f"raised {type(ex).__name__}: {str(ex).splitlines()[0][:160]}"
            failed = True
        if failed and got != "n/a" and not got.startswith("raised"):
            got += " (after an earlier path raised)"
        res[path] = got
        log.kinds.clear()
        dev.wait(dev.launched)  # (host: releases the held forward)
    if bridge is not None:
        bridge.detach()
    return res


def sync_proof(device: str = "cpu", forward_ms: float = 20.0) -> dict[str, dict[str, str]]:
    """Every path of the bridged engine (and of a native one, the control) run on the
    scheduler's stream with a forward in flight on the forward stream. CUDA: under
    `torch.cuda.set_sync_debug_mode('error')` (and Event/Stream.synchronize refused): "ok" or
    the error. Host: the waits `ModelReader` counted ("ok" when none). Each path runs on
    state the paths before it left; one that raised may leave the next on odd state (said)."""
    import torch

    cuda = device.startswith("cuda")
    shape = Shape(layers=4, swa_pages=256, full_pages=1024, requests=130, max_context=4096)
    out: dict[str, dict[str, str]] = {}
    with published(), contextlib.ExitStack() as stack:
        dev: Any = CudaDevice(device) if cuda else HostDevice()
        stack.callback(dev.close)
        if cuda:
            stack.enter_context(torch.cuda.stream(dev.sched))
        for name in ("native", "bridged"):
            out[name] = _proof_one(name, shape, device, dev, forward_ms)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m kvledger.tools.bench.sglang_serving proof [--device cuda]`: the proof's table."""
    import argparse
    import json

    warnings.filterwarnings("ignore", category=UserWarning)
    p = argparse.ArgumentParser(prog="python -m kvledger.tools.bench.sglang_serving")
    p.add_argument("what", choices=("proof",))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--forward-ms", type=float, default=20.0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    dev = "cuda:0" if a.device == "cuda" else "cpu"
    r = sync_proof(dev, a.forward_ms)
    mode = (
        f"sync debug mode 'error', a {a.forward_ms:g} ms forward in flight"
        if a.device == "cuda"
        else "host model of CUDA's order, a forward in flight until the path ends"
    )
    print(f"no-synchronisation proof on {dev} ({mode}):")
    for path in PROOF_PATHS:
        print(f"  {path:16s} native: {r['native'][path]:40s} bridged: {r['bridged'][path]}")
    if a.json:
        print(json.dumps(r, indent=2))
    print(f"  ({', '.join(WAITS_BY_DESIGN)}: waits by design, once, when a rank closes)")
    bad = [
        p
        for p in PROOF_PATHS
        if (r["bridged"][p].startswith("raised") if p in WAITS_BY_DESIGN
            else r["bridged"][p] not in ("ok", "n/a"))
    ]  # fmt: skip
    return 1 if bad else 0
