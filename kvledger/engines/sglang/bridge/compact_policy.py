"""When a bridged pool compacts in a server: the one policy the plugin and `kvledger bench
sglang` both run (docs/sglang-bridge.md#compaction-in-a-server).

`CompactionPolicy.step(bridge)` is called at the points where SGLang has no batch in flight
(the plugin: after each batch's result in SGLang's normal loop, and when the scheduler is
idle in either loop; the bench: after each churn event). It costs a count of the store's
mapped pages unless compaction is due, which is when the page ids mapped, with the spares
the background mapper may still map ahead up to the watermark counted as mapped, exceed the
packing bound (the held rows packed, plus the spares the store keeps, plus one: the bound
`allocator.rows.packing.over_bound_soon` checks, with the rows SGLang took or gave back since
the journal's last replay counted from the hooks' records, so the check replays nothing) by more than `excess_pages`. Then `Bridge.compact`
moves at most `max_moves` rows: a budget per step, so that one call costs at most
`max_moves` row copies in every layer (128 rows of DeepSeek-V4's 43 layers: about 0.8 GB
copied, under a millisecond on an H200); a finish that leaves more to move is worked off over
the next steps. Everything runs on the scheduler's thread: compaction rewrites SGLang's
index mapping and free list, which only that thread may touch. It never waits for the device
there: the pages it empties are unmapped once an event behind its copies has signalled, by
the next trim on that thread or by the background mapper (kvledger.engines.sglang.bridge.compact).

Off with `KVLEDGER_SGLANG_DSV4_COMPACT=0`; `KVLEDGER_SGLANG_DSV4_COMPACT_SLACK=N` sets
`excess_pages` (kvledger.engines.sglang.switches). With a slack of N a step compacts only once the
page ids are more than N over the bound, and then back down to the bound: N page ids of
memory at most for far fewer compactions, each moving more rows (the trade measured in
docs/benchmarks-history.md and described in docs/sglang-bridge.md#compaction-in-a-server).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from allocator.checks import check_count
from allocator.rows import packing
from allocator.states import PageState

EXCESS_PAGES = 0  # the default slack: compact as soon as the page ids exceed the bound
MAX_MOVES_PER_STEP = 128  # rows moved by one step at most


@dataclass
class CompactionPolicy:
    """Compact a bridged pool when its mapped page ids (with the spares the mapper may still
    map ahead) exceed the packing bound by more than `excess_pages`, moving at most
    `max_moves` rows a step. `enabled=False`: never."""

    excess_pages: int = EXCESS_PAGES
    max_moves: int = MAX_MOVES_PER_STEP
    enabled: bool = True
    steps: int = 0  # calls of `step`
    runs: int = 0  # steps that compacted (found it due)
    rows_moved: int = 0

    def __post_init__(self) -> None:
        check_count("excess_pages", self.excess_pages, 0)
        check_count("max_moves", self.max_moves, 1)

    @classmethod
    def from_env(cls, env: Any = None) -> CompactionPolicy:
        """The production policy: on unless `KVLEDGER_SGLANG_DSV4_COMPACT` says off, with the
        slack `KVLEDGER_SGLANG_DSV4_COMPACT_SLACK` gives (0 by default); a malformed value
        raises ValueError naming it."""
        from kvledger.engines.sglang.switches import compaction_enabled, compaction_slack

        return cls(excess_pages=compaction_slack(env), enabled=compaction_enabled(env))

    def excess(self, bridge: Any) -> int:
        """Page ids mapped beyond the packing bound now, counting as mapped the spares the
        background mapper may still map ahead (up to the watermark; 0 when the bridge is not
        active).
        The held rows are the follower's plus the net rows SGLang's allocator took since the
        journal's last replay (counts the hooks recorded: nothing replayed or read from the
        device; a release staged for a merge counts once the merge is replayed)."""
        f, store, policy = bridge.follower, bridge.store, bridge.policy
        if not bridge.active or f is None or store is None or policy is None:
            return 0
        j = policy.journal
        held = max(0, f.held_rows + j.net - j.replayed_net)
        packed = -(-((held + f.first_row) * f.row_bytes) // store.page_bytes)
        bound = packed + store.policy.max_spare_pages + 1
        # The spares the mapper may still map ahead count as mapped: checked without them, a
        # step leaves the pages in use two beyond packed while few spares are mapped, and the
        # mapper's next maps ahead take the page ids over the bound before the next step.
        return store.state.count(PageState.MAPPED) + packing.spares_to_come(f) - bound

    def due(self, bridge: Any) -> bool:
        return self.enabled and self.excess(bridge) > self.excess_pages

    def step(self, bridge: Any) -> int:
        """Compact `bridge` if due, within the budget; returns the rows moved. Call it on the
        thread that drives SGLang's allocator, with no batch in flight."""
        self.steps += 1
        if not self.due(bridge):
            return 0
        self.runs += 1
        moved = int(bridge.compact(self.max_moves))
        self.rows_moved += moved
        return moved

    def describe(self) -> str:
        if not self.enabled:
            return "off (KVLEDGER_SGLANG_DSV4_COMPACT=0)"
        return (
            "when mapped page ids (with the spares still to be mapped ahead) exceed the "
            f"packing bound by more than {self.excess_pages} (the slack), back to the bound, "
            f"at most {self.max_moves} rows a step"
        )

    def stats(self) -> dict[str, int]:
        return {
            "compaction_steps": self.steps,
            "compaction_runs": self.runs,
            "compaction_rows_moved": self.rows_moved,
        }
