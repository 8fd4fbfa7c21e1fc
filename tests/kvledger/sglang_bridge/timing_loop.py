"""A small interleaved timing loop: SGLang 0.5.23's SWA allocator native vs bridged, one process.

    .venv-sglang/bin/python -m tests.kvledger.sglang_bridge.timing_loop [--rounds N]

Not the benchmark (`kvledger bench sglang` is); the bridge engineer's own check of the
bridge's hot path on the host backend. Workload (issue 13): page 256, window 128; 256
running requests with 1000-token prompts, each decoding 256 tokens then finishing. A
decode step is: SWA window eviction of every request, one decode token per request, one
finish and one admission. Also a 4096-token alloc+release round trip and fill/drain
cycles (empty to 256 admitted requests and back). Two rigs (SGLang pool, allocator and
request table), one native and one bridged on the host backend at 2 MiB granularity with
the bridge's default pool options, are driven identically; rounds alternate which goes
first. torch is pinned to one intra-op thread. Prints medians, min, max and sample counts.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from accounting.ledger import Ledger
from allocator.host import HostBackend
from kvledger.bench.sglang_pool import Sizes, build_allocator, build_pool, build_req_to_token
from kvledger.sglang_bridge import ENV_ENABLE, attach
from tests.kvledger import sglang_rig as rig

REQS = 256
PROMPT = 1000
DECODE = 256
SWA_PAGES = 1536
MAX_LEN = 4096 + 8
RATIOS = [0, 4]  # two layers: the bridge's host cost does not depend on the layer count


def make(bridged: bool) -> Any:
    full_pages = (REQS + 20) * (PROMPT + DECODE + 8) // rig.PAGE
    sizes = Sizes.from_pages(
        requests=REQS + 8, swa_pages=SWA_PAGES, full_pages=full_pages, page=rig.PAGE
    )
    pool = build_pool(sizes, ratios=RATIOS, page=rig.PAGE, window=rig.WINDOW, device="cpu")
    r2t = build_req_to_token(REQS + 8, MAX_LEN, "cpu")
    alloc = build_allocator(
        pool, r2t, full_tokens=full_pages * rig.PAGE, page=rig.PAGE, device="cpu"
    )
    out: dict[str, Any] = {"pool": pool, "alloc": alloc, "sched": rig.Scheduler(alloc, r2t)}
    if bridged:
        backend = HostBackend()
        out["backend"] = backend
        out["bridge"] = attach(
            pool, Ledger(), allocator=alloc, backend=backend, env={ENV_ENABLE: "1"}
        )
        assert out["bridge"].active, out["bridge"].reason
    return out


class Decode:
    """256 requests at staggered positions; `step()` is one scheduler step."""

    def __init__(self, r: Any) -> None:
        self.s = r["sched"]
        self.reqs = [self.s.prefill(PROMPT + i) for i in range(REQS)]
        self.done = [i for i in range(REQS)]  # decode tokens each has, staggered

    def step(self) -> None:
        s = self.s
        for q in self.reqs:
            s.evict_window(q)
        s.decode(self.reqs)
        oldest = max(range(len(self.reqs)), key=lambda i: self.reqs[i].seq_len)
        s.finish(self.reqs.pop(oldest))
        self.reqs.append(s.prefill(PROMPT))


def roundtrip(r: Any) -> None:
    s = r["sched"]
    s.finish(s.prefill(4096))


def fill_drain(r: Any) -> None:
    s = r["sched"]
    reqs = [s.prefill(PROMPT) for _ in range(REQS)]
    for q in reqs:
        s.finish(q)


def churn(r: Any, ops: int, seed: int = 7) -> tuple[int, int, int]:
    """Random admissions and finishes between 10% and 90% of the SWA rows; after each op
    (the mapper idle) check mapped page ids <= ceil(held rows / rows per VMM page) + max
    spare pages + 1. Returns (samples, samples over the bound, largest excess)."""
    import math
    import random

    rng = random.Random(seed)
    s, bridge = r["sched"], r["bridge"]
    store = bridge.store
    per_page = store.page_bytes // bridge.facts.row_bytes
    rows = bridge.facts.rows - 1
    live: list[Any] = []
    over = worst = 0
    for _ in range(ops):
        held = bridge.follower.held_rows
        admit = held < 0.1 * rows or (held < 0.9 * rows - 8 and rng.random() < 0.5)
        if admit:
            live.append(s.prefill(rng.randrange(1, 8) * rig.PAGE))
        elif live:
            s.finish(live.pop(rng.randrange(len(live))))
        bridge.wait_idle()
        st = bridge.stats()
        bound = math.ceil((st["held_pages"] + 1) / per_page) + store.max_spare_pages + 1
        excess = st["mapped_pages"] - bound
        over += excess > 0
        worst = max(worst, excess)
    for q in live:
        s.finish(q)
    return ops, over, worst


def timed(fn: Callable[[], None], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def summary(name: str, nat: list[float], br: list[float]) -> None:
    ratios = [b / a for a, b in zip(nat, br, strict=True)]
    print(
        f"{name}: native median {statistics.median(nat) * 1e6:.0f} us, bridged median "
        f"{statistics.median(br) * 1e6:.0f} us; ratio median {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}, n={len(ratios)} rounds)"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--churn", type=int, default=300, help="churn operations (0: none)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    with rig.published():
        nat, br = make(False), make(True)
        # fill/drain first, from empty, counting maps per cycle
        fd_n: list[float] = []
        fd_b: list[float] = []
        maps: list[int] = []
        store = br["bridge"].store
        for k in range(args.rounds):
            order = [(nat, fd_n), (br, fd_b)] if k % 2 == 0 else [(br, fd_b), (nat, fd_n)]
            for r, out in order:
                m0 = store.stats()["pages_mapped_total"] if r is br else 0
                out.append(timed(functools.partial(fill_drain, r), 1))
                if r is br:
                    br["bridge"].mapper.wait_idle()
                    maps.append(store.stats()["pages_mapped_total"] - m0)
        summary("fill/drain cycle", fd_n, fd_b)
        print(f"  maps per fill/drain cycle: {maps}")
        rt_n: list[float] = []
        rt_b: list[float] = []
        for k in range(args.rounds):
            order = [(nat, rt_n), (br, rt_b)] if k % 2 == 0 else [(br, rt_b), (nat, rt_n)]
            for r, out in order:
                out.append(timed(functools.partial(roundtrip, r), 20))
        summary("4096-token round trip", rt_n, rt_b)
        dn, db = Decode(nat), Decode(br)
        for _ in range(5):
            dn.step()
            db.step()
        br["bridge"].mapper.wait_idle()
        st_n: list[float] = []
        st_b: list[float] = []
        m0 = store.stats()["pages_mapped_total"]
        u0 = store.stats()["pages_unmapped_total"]
        for k in range(args.rounds):
            gc.collect()
            order = [(dn, st_n), (db, st_b)] if k % 2 == 0 else [(db, st_b), (dn, st_n)]
            for d, out in order:
                out.append(timed(d.step, args.steps))
        summary("decode step", st_n, st_b)
        s = br["bridge"].stats()
        print(
            f"  during decode: {s['pages_mapped_total'] - m0} pages mapped, "
            f"{s['pages_unmapped_total'] - u0} unmapped; waited_allocs {s['waited_allocs']}, "
            f"divergences {s['divergences']}, held rows {s['held_pages']}, "
            f"mapped pages {s['mapped_pages']}"
        )
        for q in db.reqs:
            br["sched"].finish(q)
        samples, over, worst = churn(br, args.churn)
        print(
            f"churn: {samples} samples, {over} over ceil(held/rows per page) + max spare + 1 "
            f"(largest excess {worst} page ids); packs {br['bridge'].hooks.packs}, divergences "
            f"{br['bridge'].stats()['divergences']}, resyncs {br['bridge'].stats()['resyncs']}"
        )
        br["bridge"].detach()
        br["backend"].close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
