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
O(running requests), never O(tokens).

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
tokens freed by window eviction, requests retracted. `kvledger.sglang.plugin.server_hooks`
counts them through HookRegistry hooks on SGLang's own calls; each read converts the
totals to each family's slots and adds what is new to its account's counters.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from accounting.engine_state import EngineState, RequestHeld, engine_state
from accounting.ledger import Account, Ledger

log = logging.getLogger(__name__)

FULL, SWA, REQ = "full", "swa", "req"
# Tree cache classes of SGLang 0.5.23 whose sizes are read, by class name (any in the MRO).
KNOWN_TREES = ("UnifiedRadixCache", "RadixCache", "PureSWARadixCache", "ChunkCache")
_NO_TREE = ("ChunkCache",)  # classes that keep no prefix tree: every slot request_only


@dataclass(frozen=True)
class Units:
    """A family's slots from SGLang's counts in `space`: slots = count * num // den."""

    space: str  # FULL (tokens of the full space), SWA (SWA tokens) or REQ (request slots)
    num: int = 1
    den: int = 1

    def of(self, count: int) -> int:
        return count * self.num // self.den


def dsv4_units(pool: Any) -> dict[str, Units]:
    """The DeepSeek-V4 families' units, from the pool's ring sizes and layout
    (docs/background.md#the-families)."""
    page = int(getattr(pool, "swa_page_size", None) or getattr(pool, "page_size", None) or 256)
    ring4 = _ring(pool, 4, 8)
    ring128 = _ring(pool, 128, 128)
    unified = bool(getattr(pool, "_unified_kv", False))
    c4_state = Units(REQ, ring4) if unified else Units(SWA, ring4, page)
    return {
        "swa_kv": Units(SWA),
        "c4_kv": Units(FULL, 1, 4),
        "c4_indexer": Units(FULL, 1, 4),
        "c128_kv": Units(FULL, 1, 128),
        "c4_attn_state": c4_state,
        "c4_indexer_state": c4_state,
        "c128_state": Units(REQ, ring128),
    }


GENERIC_UNITS = {
    "k": Units(FULL),
    "v": Units(FULL),
    "kv": Units(FULL),
    "swa_k": Units(SWA),
    "swa_v": Units(SWA),
    "swa_kv": Units(SWA),
}


def _ring(pool: Any, ratio: int, default: int) -> int:
    get = getattr(pool, "get_ring_size", None)
    try:
        return int(get(ratio)) if callable(get) else default
    except Exception:
        return default


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
        self._evicted_seen: dict[str, tuple[int, int]] = {}  # family -> (tree, window) slots
        self._first_seen: dict[str, float] = {}
        self._failed = ""
        self._closed = False
        self.static_notes = self._static_notes()
        self._per_slot = tuple(
            (
                f,
                u.space,
                u.num,
                u.den,
                sum(b.slot_bytes for a in self.family_accounts[f] for b in a.buffers),
            )
            for f, u in self.units.items()
        )
        self._swa_component = _swa_component()
        for family, u in self.units.items():  # evictions from now on
            for account in self.family_accounts[family]:
                self._evicted_seen[account.key] = self._evicted_now(u)
        ledger.add_probe(self.read)
        ledger.set_engine_state(self.state)

    # -- what is known before reading -------------------------------------------------
    def _static_notes(self) -> list[str]:
        notes = []
        tree = self.tree
        known = None if tree is None else _known(tree)
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
        known = _known(tree)
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
        for family, accounts in self.family_accounts.items():  # occupancy first: known
            units = self.units.get(family)  # even if the tree's sizes then fail
            if units is not None and family not in self.bridged:
                occupied = units.of(counts[units.space])
                for account in accounts:
                    account.on_slots(occupied, max(occupied, account.peak_occupied_slots))
        mode = self._tree_mode()
        tree = self._tree_tokens() if mode == "tree" else None
        for family, accounts in self.family_accounts.items():
            units = self.units.get(family)
            for account in accounts:
                if units is None or mode == "unknown":
                    account.clear_holders()
                elif tree is None or units.space == REQ:
                    account.set_holders(0, 0)
                else:
                    protected, evictable = tree[units.space]
                    account.set_holders(units.of(protected), units.of(evictable))
                if units is not None:
                    self._count_evicted(account, units)
        self._state = engine_state(
            holders_from=tree_class(self.tree),
            notes=self.static_notes,
            retracted_requests_total=self.pressure.retracted_requests,
            requests=self._requests(),
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

    def _evicted_now(self, units: Units) -> tuple[int, int]:
        """(tree, window) evicted slots of a family of `units` since the process started."""
        p = self.pressure
        if units.space == FULL:
            return (units.of(p.tree_full_tokens), 0)
        if units.space == SWA:
            return (units.of(p.tree_swa_tokens), units.of(p.window_swa_tokens))
        return (0, 0)

    def _count_evicted(self, account: Account, units: Units) -> None:
        now = self._evicted_now(units)
        seen = self._evicted_seen.setdefault(account.key, now)
        account.count_evicted(now[0] - seen[0])
        account.count_evicted(now[1] - seen[1], window=True)
        self._evicted_seen[account.key] = now

    # -- per request --------------------------------------------------------------------
    def _requests(self) -> list[RequestHeld]:
        if self.running is None:
            return []
        now = time.time()
        out = []
        seen: dict[str, float] = {}
        first_seen = self._first_seen
        per_slot = self._per_slot
        swa_ct = self._swa_component
        for req in self.running():
            kv = getattr(req, "kv", req)
            if getattr(kv, "req_pool_idx", None) is None:
                continue
            rid = str(getattr(req, "rid", kv.req_pool_idx))
            tokens = int(getattr(kv, "kv_allocated_len", 0) or getattr(req, "seq_len", 0) or 0)
            swa_tokens = tokens
            if swa_ct is not None:
                get = getattr(kv, "get_evicted_seqlen", None)
                if get is not None:
                    swa_tokens = max(tokens - int(get(swa_ct)), 0)
            count = {FULL: tokens, SWA: swa_tokens, REQ: 1}
            by_family = {
                family: count[space] * num // den * slot_bytes
                for family, space, num, den, slot_bytes in per_slot
            }
            first = first_seen.get(rid, now)
            seen[rid] = first
            out.append(
                RequestHeld(rid, tokens, max(now - first, 0.0), sum(by_family.values()), by_family)
            )
        self._first_seen = seen
        return out

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
