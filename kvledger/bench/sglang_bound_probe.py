"""The churn trace on the bridged engine alone, every sample checked against the packing bound.

    python -m kvledger.bench.sglang_bound_probe --events 3000 --churn-gap-ms 3 [bench options]

Runs `--events` events of the bench's churn trace (`sglang_cases.Churn`, the same seed) on
the bridged engine only, each followed by a step of the production compaction policy and
`--churn-gap-ms` of pause, and after each event past `--churn-warmup` checks the bridge's
mapped page ids against the bound `kvledger bench sglang` checks (ceil(held rows / rows per
VMM page) + max spare pages + 1, held rows with row 0). Each sample over the bound is
printed with the store's and the policy's state at that moment (what the compaction step saw
before and after, the spares, the pages in use beyond packed, the fences, the mapper's next
map), so that a sample over the bound names its cause. Without the native and control
engines the bridged engine's timing differs from the bench's; this is for the bound, not for
time. Exits 1 when a sample was over the bound.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from kvledger.argtypes import one_line_errors
from kvledger.bench import sglang_cases as cases
from kvledger.bench.sglang import add_arguments


def state_line(bridge: Any, policy: Any) -> str:
    """The store's and the policy's state, for a sample over the bound."""
    from allocator.rows import compaction, packing

    f, store, front = bridge.follower, bridge.store, bridge.policy
    j = front.journal
    return (
        f"excess {policy.excess(bridge)} spares {len(store.spares)} "
        f"to_come {packing.spares_to_come(f)} follower_held {f.held_rows} "
        f"unreplayed {j.net - j.replayed_net} journal {len(j)} packed {packing.packed_pages(f)} "
        f"in_use {store.in_use.count(1)} beyond_packed {compaction.in_use_beyond_packed(f)} "
        f"fences {len(store.fences)} busy {store.busy} map_target {store.policy.map_target()} "
        f"pinned {len(store.pinned)}"
    )


def run(args: argparse.Namespace, out: Any = sys.stdout) -> dict[str, int]:
    import torch

    from kvledger.sglang.bridge.compact_policy import CompactionPolicy

    torch.set_num_threads(args.threads)
    cases.apply_defaults(args)
    over = checked = 0
    with cases.variants(args) as vs:
        b = cases.bridged_of(vs)
        bridge, e = b.bridge, b.engine
        geometry = cases.geometry_of(b)
        policy = CompactionPolicy.from_env()
        churn = cases.Churn(args.seed, args.swa_pages)
        e.finish_all()
        cases._quiesce(b)
        for i in range(args.events):
            kind = churn.event(e)
            before = policy.excess(bridge)
            moved = policy.step(bridge)
            e.sync()
            if i >= args.churn_warmup:
                held = e.held_swa_pages()
                bound = cases.churn_bound(held, geometry, args.max_spare_pages)
                mapped = b.mapped_spare_physical()[0]
                checked += 1
                if mapped > bound:
                    over += 1
                    print(
                        f"over: event {i} ({kind}), mapped {mapped} bound {bound} held {held}, "
                        f"compaction step: excess before {before}, rows moved {moved}; "
                        + state_line(bridge, policy),
                        file=out,
                        flush=True,
                    )
            if args.churn_gap_ms:
                time.sleep(args.churn_gap_ms / 1000)
    print(
        f"{args.events} events, {checked} samples checked, {over} over the bound; "
        f"compaction: {policy.runs} runs, {policy.rows_moved} rows moved",
        file=out,
    )
    return {"events": args.events, "checked": checked, "over": over}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvledger.bench.sglang_bound_probe",
        description=(__doc__ or "").split("\n")[0],
    )
    one_line_errors(p)
    add_arguments(p)
    p.add_argument("--events", type=int, default=3000, help="churn events (3000)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if not 0 <= args.churn_warmup < args.events:
        p.error(
            f"--events={args.events} --churn-warmup={args.churn_warmup}: expected 0 <= warmup < events"
        )
    return 1 if run(args)["over"] else 0


if __name__ == "__main__":
    sys.exit(main())
