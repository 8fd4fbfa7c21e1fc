"""Who holds an SGLang 0.5.23 scheduler's KV slots, read from its own objects, per family.

    reader = HolderReader(ledger, accounts, tree=scheduler.tree_cache,
                          allocator=scheduler.token_to_kv_pool_allocator,
                          req_to_token=scheduler.req_to_token_pool, pool=pool,
                          bridged={"swa_kv"}, running=lambda: scheduler.running_batch.reqs)
    ...                      # every ledger snapshot now reads the holders first
    reader.close()

What is read, per snapshot, on whichever thread takes it (the scheduler's when it
publishes, the publisher's idle thread otherwise): the tree cache's own counters of
evictable and protected tokens (`full_evictable_size`, `full_protected_size`,
`swa_evictable_size`, `swa_protected_size`: plain integers the tree keeps as it
inserts, locks and evicts; never a walk of the tree), the allocator's free counts
(`full_available_size`, `swa_available_size`: a length and a product) and the
request pool's (`available_size`). That is O(families); the per-request footprints add
O(running requests), never O(tokens) (`kvledger.engines.sglang.footprints`: a few attribute reads
and integer operations per request, the per-family split only for the `MAX_REQUESTS`
listed). What a read costs: `kvledger bench sglang --part holders` (docs/benchmarks.md).

Each family of the pool counts its slots in one of three spaces, converted from
SGLang's tokens (`Units`): the full-token space (c4_kv and c4_indexer one row per 4
tokens, c128_kv one per 128, an MHA pool's k/v one per token), the SWA space (swa_kv
one per token, the SWA-addressed c4 compressor rings `ring` rows per SWA page) or the
request slots (the c128 ring, and the c4 rings of the unified-KV layout: `ring` rows
per request; the tree never holds those, so they are all `request_only`). The tree's
full-space sizes give the holders of the full-space families, its SWA sizes those of
the SWA-space ones.

Occupancy: a family whose account nobody else reports (SGLang's own tensors) gets its
occupied slots from the same counts (`Account.on_slots`); a bridged family (kvledger's
VMM pool, `bridged`) keeps the count its allocator hooks report (`sync`, the bridge's
`flush`, replays what they recorded first, so both counts are of the same moment), and
only its holders are set here. Then `Account.set_holders(protected, evictable)`: the rest of occupied is
`request_only`, and a tree claiming more than is occupied shows as a violation.

What cannot be read is said, never guessed (`EngineState.notes`, shown in /debug/kv):
no tree cache or a disabled radix cache (every slot `request_only`), a cache class this
module does not know or one lacking the sizes (`unattributed`), HiCache's host tier
(host copies are not this pool's device slots; not counted), a family of no known space
(`unattributed`). A failure inside a read is caught: the holders go `unattributed`, the
note names the error, SGLang is never raised into.

Pressure (`Pressure`, one per process): tokens the tree evicted (full and SWA), SWA
tokens freed by window eviction, requests retracted. `kvledger.engines.sglang.plugin.server_hooks`
counts them through HookRegistry hooks on SGLang's own calls; each read converts the
totals to each family's slots and adds what is new to its account's counters.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from accounting.engine_state import EngineState, engine_state
from accounting.ledger import Account, Ledger
from kvledger.engines.sglang.footprints import Footprints
from kvledger.engines.sglang.units import (  # noqa: F401 - re-exported: the reader's public names
    FULL,
    GENERIC_UNITS,
    REQ,
    SWA,
    Units,
    dsv4_units,
)

log = logging.getLogger(__name__)

# Tree cache classes of SGLang 0.5.23 whose sizes are read, by class name (any in the MRO).
KNOWN_TREES = ("UnifiedRadixCache", "RadixCache", "PureSWARadixCache", "ChunkCache")
_NO_TREE = ("ChunkCache",)  # classes that keep no prefix tree: every slot request_only


class Pressure:
    """This process's eviction and retraction totals, added to by SGLang hooks (plain
    integer additions under the GIL; a read sees each total as of some moment)."""

    def __init__(self) -> None:
        self.tree_full_tokens = 0  # full-space tokens the tree evicted
        self.tree_swa_tokens = 0  # SWA tokens the tree evicted (tombstoned prefixes)
        self.window_swa_tokens = 0  # SWA tokens freed as they left a request's window
        self.retracted_requests = 0

    def tree_evicted(self, full_tokens: int, swa_tokens: int) -> None:
        self.tree_full_tokens += max(int(full_tokens), 0)
        self.tree_swa_tokens += max(int(swa_tokens), 0)

    def window_evicted(self, swa_tokens: int) -> None:
        self.window_swa_tokens += max(int(swa_tokens), 0)

    def retracted(self, requests: int) -> None:
        self.retracted_requests += max(int(requests), 0)


PRESSURE = Pressure()


def tree_class(tree: Any) -> str:
    return "none" if tree is None else type(tree).__name__


def _known(tree: Any) -> str | None:
    names = {c.__name__ for c in type(tree).__mro__}
    return next((n for n in KNOWN_TREES if n in names), None)


class HolderReader:
    """Reads the holders of one pool's families at every snapshot of `ledger` (its probe)."""

    def __init__(
        self,
        ledger: Ledger,
        accounts: Mapping[str, Account | Sequence[Account]],
        *,
        tree: Any,
        allocator: Any,
        req_to_token: Any,
        units: Mapping[str, Units],
        bridged: Iterable[str] = (),
        running: Callable[[], Iterable[Any]] | None = None,
        pressure: Pressure = PRESSURE,
        sync: Callable[[], None] | None = None,
    ) -> None:
        self.ledger = ledger
        # family -> its accounts (one index space, or one per buffer where SGLang's own VMM
        # owner registers each buffer apart: each gets the family's slots)
        self.family_accounts: dict[str, tuple[Account, ...]] = {
            f: (a,) if isinstance(a, Account) else tuple(a) for f, a in accounts.items()
        }
        self.accounts = {f: accs[0] for f, accs in self.family_accounts.items() if accs}
        self.tree = tree
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.units = {f: units[f] for f in self.accounts if f in units}
        self.bridged = frozenset(bridged)
        self.running = running
        self.pressure = pressure
        self.sync = sync  # brings the bridged families' counts up to SGLang's first
        self._lock = threading.Lock()
        self._state = EngineState(holders_from=tree_class(tree))
        self._evicted_seen: dict[str, tuple[int, int]] = {}  # account -> (tree, window) slots
        self._failed = ""
        self._closed = False
        self._known_tree = None if tree is None else _known(tree)  # its class never changes
        self.static_notes = self._static_notes()
        # (account, its family's units or None, whether this reader sets its occupancy),
        # every account of every family: what each read walks (O(families))
        self._plan: tuple[tuple[Account, Any, bool], ...] = tuple(
            (account, self.units.get(f), f in self.units and f not in self.bridged)
            for f, accs in self.family_accounts.items()
            for account in accs
        )
        self.footprints = Footprints(
            [
                (f, u, sum(b.slot_bytes for a in self.family_accounts[f] for b in a.buffers))
                for f, u in self.units.items()
            ],
            swa_component=_swa_component(),
        )
        for account, u, _ in self._plan:  # evictions from now on
            if u is not None:
                self._evicted_seen[account.key] = self._evicted_now(u)
        self._pressure_seen = self._pressure_now()
        ledger.add_probe(self.read)
        ledger.set_engine_state(self.state)

    # -- what is known before reading -------------------------------------------------
    def _static_notes(self) -> list[str]:
        notes = []
        tree = self.tree
        known = self._known_tree
        if tree is None:
            notes.append("no tree cache: every occupied slot is held by requests only")
        elif known is None:
            notes.append(
                f"tree cache class {type(tree).__name__} is not one kvledger reads "
                f"({', '.join(KNOWN_TREES)}): holders unattributed"
            )
        elif known in _NO_TREE:
            notes.append(f"{known} keeps no prefix tree: every occupied slot is request_only")
        elif getattr(tree, "disable", False):
            notes.append("radix cache disabled: every occupied slot is held by requests only")
        if tree is not None and getattr(tree, "cache_controller", None) is not None:
            notes.append(
                "HiCache host tier on: prefixes copied to host memory are not device KV "
                "slots and are not counted here (their device copies are)"
            )
        for family in sorted(set(self.accounts) - set(self.units) - {"other"}):
            notes.append(f"family {family}: no known index space, holders unattributed")
        return notes

    def _tree_mode(self) -> str:
        tree = self.tree
        if tree is None:
            return "none"
        known = self._known_tree
        if known is None:
            return "unknown"
        if known in _NO_TREE or getattr(tree, "disable", False):
            return "none"
        return "tree"

    # -- the probe ---------------------------------------------------------------------
    def read(self) -> None:
        """Set every account's occupancy (unless bridged) and holders as of now. Never raises."""
        if self._closed:
            return
        with self._lock:
            try:
                self._read()
                self._failed = ""
            except Exception as e:
                if not self._failed:
                    log.warning(
                        "kvledger: reading the KV holders failed: %s: %s", type(e).__name__, e
                    )
                self._failed = f"reading the holders failed: {type(e).__name__}: {e}"
                for account in self._all():
                    account.clear_holders()
                self._state = engine_state(
                    holders_from=tree_class(self.tree),
                    notes=[*self.static_notes, self._failed],
                    retracted_requests_total=self.pressure.retracted_requests,
                )

    def _read(self) -> None:
        if self.sync is not None and self.bridged:
            self.sync()
        counts = self._counts()
        for account, units, own in self._plan:  # occupancy first: known even if the
            if own:  # tree's sizes then fail
                occupied = units.of(counts[units.space])
                account.on_slots(occupied, max(occupied, account.peak_occupied_slots))
        self._count_evicted()
        mode = self._tree_mode()
        tree = self._tree_tokens() if mode == "tree" else None
        for account, units, _ in self._plan:
            if units is None or mode == "unknown":
                account.clear_holders()
            elif tree is None or units.space == REQ:
                account.set_holders(0, 0)
            else:
                protected, evictable = tree[units.space]
                account.set_holders(units.of(protected), units.of(evictable))
        listed, distribution = (
            self.footprints.read(self.running(), time.time())
            if self.running is not None
            else ([], None)
        )
        self._state = engine_state(
            holders_from=tree_class(self.tree),
            notes=self.static_notes,
            retracted_requests_total=self.pressure.retracted_requests,
            requests=listed,
            distribution=distribution,
        )

    def _counts(self) -> dict[str, int]:
        a = self.allocator
        if hasattr(a, "full_available_size"):
            full = int(a.size_full) - int(a.full_available_size())
        else:
            full = int(a.size) - int(a.available_size())
        swa = int(a.size_swa) - int(a.swa_available_size()) if hasattr(a, "size_swa") else 0
        r2t = self.req_to_token
        req = int(r2t.size) - int(r2t.available_size()) if r2t is not None else 0
        return {FULL: full, SWA: swa, REQ: req}

    def _tree_tokens(self) -> dict[str, tuple[int, int]]:
        t = self.tree
        if hasattr(t, "full_protected_size"):
            full = (int(t.full_protected_size()), int(t.full_evictable_size()))
        else:
            full = (int(t.protected_size()), int(t.evictable_size()))
        swa = (0, 0)
        if hasattr(t, "swa_protected_size"):
            swa = (int(t.swa_protected_size()), int(t.swa_evictable_size()))
        return {FULL: full, SWA: swa}

    def _pressure_now(self) -> tuple[int, int, int]:
        p = self.pressure
        return (p.tree_full_tokens, p.tree_swa_tokens, p.window_swa_tokens)

    def _evicted_now(self, units: Units) -> tuple[int, int]:
        """(tree, window) evicted slots of a family of `units` since the process started."""
        p = self.pressure
        if units.space == FULL:
            return (units.of(p.tree_full_tokens), 0)
        if units.space == SWA:
            return (units.of(p.tree_swa_tokens), units.of(p.window_swa_tokens))
        return (0, 0)

    def _count_evicted(self) -> None:
        """Add to each account what was evicted since the last read; nothing to do (one
        comparison) when the pressure totals have not moved."""
        pressure = self._pressure_now()
        if pressure == self._pressure_seen:
            return
        for account, units, _ in self._plan:
            if units is None:
                continue
            now = self._evicted_now(units)
            seen = self._evicted_seen.setdefault(account.key, now)
            account.count_evicted(now[0] - seen[0])
            account.count_evicted(now[1] - seen[1], window=True)
            self._evicted_seen[account.key] = now
        self._pressure_seen = pressure  # only once every account has its share

    def _all(self) -> Iterable[Account]:
        return (a for accs in self.family_accounts.values() for a in accs)

    def state(self) -> EngineState:
        return self._state

    def close(self) -> None:
        """Stop reading: the probe and the engine state are removed, holders unattributed,
        and the occupancy this reader reported goes back to 0 (nobody reports it now), so
        the accounts can be removed. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.ledger.remove_probe(self.read)
        self.ledger.set_engine_state(None)
        for family, accounts in self.family_accounts.items():
            for account in accounts:
                account.clear_holders()
                if family in self.units and family not in self.bridged:
                    account.on_slots(0, account.peak_occupied_slots)

    def __enter__(self) -> HolderReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _swa_component() -> Any:
    """SGLang's ComponentType.SWA (what a request's SWA evicted length is keyed by), or None."""
    try:
        from sglang.srt.mem_cache.base_prefix_cache import ComponentType

        return ComponentType.SWA
    except Exception:
        return None
