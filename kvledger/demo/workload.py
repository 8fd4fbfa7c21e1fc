"""A built-in workload for the demo: requests arrive, prefill, decode and finish, so every figure moves.

It plays the part of an engine's scheduler over a DeepSeek-V4-shaped pool, one step
at a time (`step()`; `start()` runs steps on a thread every `step_seconds`):

- Requests arrive as a Poisson process (`rate` per second of simulated time), with
  prompt and output lengths drawn uniformly from their ranges; a full queue
  rejects new arrivals.
- Admission (one request per step, up to `max_running`) takes the prompt's SWA
  slots in one `SwaPool.alloc` and the request's final compressed rows and state
  rows are checked against what the runtime accounts still have free.
- Each step decodes one token for every running request: one SWA slot each, in one
  `alloc` call; the SWA slots of tokens that left the `window` (128 tokens) are
  freed in one `free` call at the next step (so a prefill's slots live for one step).
- Compressed rows grow with the tokens (`c4_kv`, `c4_indexer`: one per 4 tokens;
  `c128_kv`: one per 128); state rows are held while a request runs
  (`c4_attn_state`, `c4_indexer_state`: 8 ring rows, 16 with speculative decoding;
  `c128_state`: 128). They are occupied and released on the runtime accounts.
- A finished request frees everything it held, but for a shared prefix (below).

Prefix sharing, as an engine's prefix tree would do it for the full-token families
(`c4_kv`, `c4_indexer`, `c128_kv`): `shared_prefixes` system prompts (lengths drawn once
from `prefix_tokens`) start `prefix_share` of the requests. The first request with a
prompt computes its prefix rows; when it finishes they stay cached instead of being freed.
The SWA slots of the prompt's last window are kept with them (an engine's tree keeps
that much SWA of a cached prefix). A later request with that prompt reuses them (a hit:
it allocates only its own rows) and
holds them locked while it runs. At most `cache_prefixes` prompts stay cached: past that,
or when an admission lacks room, the least recently used unlocked one is evicted (its
rows released, counted as evicted). After every step the accounts' holders are set
(`Account.set_holders`): cached prefixes locked by a running request are
`tree_protected`, the others `tree_evictable`, the rest `request_only`; SWA tokens that
left the window are counted as window evictions, and `engine_state()` carries every
running request's footprint (the demo hands it to the ledger).

`close()` stops the thread and frees every slot and row still held, so the
ledger's occupied figures return to zero.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from accounting.engine_state import EngineState, RequestHeld, engine_state
from allocator.errors import CapacityError

log = logging.getLogger(__name__)
LOG_EVERY_S = 60.0  # a failing step's log line, at most this often


class RowAccount(Protocol):
    """A runtime-owned account (accounting.Account): rows occupied and released by count."""

    capacity_slots: int

    def occupy(self, slots: int) -> None: ...
    def release(self, slots: int) -> None: ...


class SlotPool(Protocol):
    def alloc(self, n: int) -> Any: ...
    def free(self, ids: Any) -> None: ...


def _per_tokens(ratio: int) -> Callable[[int], int]:
    return lambda tokens: tokens // ratio


def _fixed(rows: int) -> Callable[[int], int]:
    return lambda tokens: rows


def row_rules(speculative: bool = False) -> dict[str, Callable[[int], int]]:
    """Rows a request holds per runtime family, as a function of its tokens so far."""
    ring = 16 if speculative else 8
    return {
        "c4_kv": _per_tokens(4),
        "c4_indexer": _per_tokens(4),
        "c128_kv": _per_tokens(128),
        "c4_attn_state": _fixed(ring),
        "c4_indexer_state": _fixed(ring),
        "c128_state": _fixed(128),
        # DeepSeek-V4.1's low ratios, on their kv_source layers: a row per 1 / 2 tokens, and
        # the ratio-2 pending-pair ring (2 rows without speculative decoding, 8 with 1 to 6
        # draft tokens: SGLang's power of two above 1 + draft tokens).
        "c1_kv": _per_tokens(1),
        "c1_indexer": _per_tokens(1),
        "c2_kv": _per_tokens(2),
        "c2_indexer": _per_tokens(2),
        "c2_state": _fixed(8 if speculative else 2),
    }


@dataclass(frozen=True)
class WorkloadConfig:
    rate: float = 1.0  # requests per second
    prompt_tokens: tuple[int, int] = (256, 2048)
    output_tokens: tuple[int, int] = (64, 512)
    step_seconds: float = 0.02
    window: int = 128
    max_running: int = 8
    max_waiting: int = 64
    speculative: bool = False
    seed: int | None = None
    shared_prefixes: int = 4  # distinct system prompts (0: no prefix sharing)
    prefix_tokens: tuple[int, int] = (512, 1536)
    prefix_share: float = 0.75  # of the requests that start with one
    cache_prefixes: int = 3  # prompts kept cached at most

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"workload rate={self.rate!r}, expected requests per second > 0")
        for name in ("prompt_tokens", "output_tokens"):
            lo, hi = getattr(self, name)
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ValueError(
                    f"workload {name}=({lo!r}, {hi!r}), expected integers 1 <= min <= max"
                )
        if not self.step_seconds > 0:
            raise ValueError(f"workload step_seconds={self.step_seconds!r}, expected > 0")
        for name in ("window", "max_running", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"workload {name}={getattr(self, name)!r}, expected >= 1")
        lo, hi = self.prefix_tokens
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(
                f"workload prefix_tokens=({lo!r}, {hi!r}), expected integers 1 <= min <= max"
            )
        if not 0.0 <= self.prefix_share <= 1.0:
            raise ValueError(f"workload prefix_share={self.prefix_share!r}, expected in [0, 1]")
        for name in ("shared_prefixes", "cache_prefixes"):
            if getattr(self, name) < 0:
                raise ValueError(f"workload {name}={getattr(self, name)!r}, expected >= 0")


# Families an engine's prefix tree keeps for a cached prefix (rows per token of it).
PREFIX_FAMILIES = ("c4_kv", "c4_indexer", "c128_kv")


@dataclass
class CachedPrefix:
    tokens: int
    rows: dict[str, int]
    locks: int = 0  # running requests that reuse it
    last_used: float = 0.0
    swa: list[int] = field(default_factory=list)  # SWA slots of its last window, kept


@dataclass
class Request:
    rid: int
    prompt: int
    output: int
    generated: int = 0
    swa: collections.deque[int] = field(default_factory=collections.deque)
    rows: dict[str, int] = field(default_factory=dict)
    prefix_id: int | None = None  # the system prompt it starts with
    prefix: int = 0  # that prompt's tokens (part of `prompt`)
    hit: bool = False  # its prefix rows are the cache's, not its own
    arrived: float = 0.0

    @property
    def tokens(self) -> int:
        return self.prompt + self.generated


class Workload:
    def __init__(
        self,
        pool: SlotPool,
        accounts: Mapping[str, RowAccount],
        config: WorkloadConfig | None = None,
    ) -> None:
        self.pool = pool
        self.config = config or WorkloadConfig()
        rules = row_rules(self.config.speculative)
        self.accounts = {f: a for f, a in accounts.items() if f in rules}
        self._rules = {f: rules[f] for f in self.accounts}
        self._rng = random.Random(self.config.seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.clock = 0.0  # simulated seconds
        self._next_arrival = self._rng.expovariate(self.config.rate)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._committed = dict.fromkeys(self.accounts, 0)  # final rows of running requests
        self._next_id = 0
        self.counts = collections.Counter[str]()
        self.swa_account: Any = accounts.get("swa_kv")
        cfg = self.config
        self.prefix_lengths = [
            self._rng.randint(*cfg.prefix_tokens) for _ in range(cfg.shared_prefixes)
        ]
        self.cache: dict[int, CachedPrefix] = {}
        self._state = EngineState(holders_from="kvledger demo workload")

    # -- one engine step ------------------------------------------------------------------
    def step(self) -> None:
        with self._lock:
            if self._closed:
                return
            cfg = self.config
            self.clock += cfg.step_seconds
            self.counts["steps"] += 1
            self._arrivals()
            freed = self._trim_windows()
            self._decode(freed)
            self._admit()
            self._finish(freed)
            if freed:
                self.pool.free(freed)
            self._publish_holders()

    def _arrivals(self) -> None:
        cfg = self.config
        while self._next_arrival <= self.clock:
            self._next_arrival += self._rng.expovariate(cfg.rate)
            if len(self.waiting) >= cfg.max_waiting:
                self.counts["rejected"] += 1
                continue
            r = Request(
                rid=self._next_id,
                prompt=self._rng.randint(*cfg.prompt_tokens),
                output=self._rng.randint(*cfg.output_tokens),
                arrived=self.clock,
            )
            if self.prefix_lengths and self._rng.random() < cfg.prefix_share:
                r.prefix_id = self._rng.randrange(len(self.prefix_lengths))
                r.prefix = self.prefix_lengths[r.prefix_id]
                r.prompt += r.prefix
            self.waiting.append(r)
            self._next_id += 1
            self.counts["arrived"] += 1

    def _trim_windows(self) -> list[int]:
        freed: list[int] = []
        w = self.config.window
        for r in self.running:
            while len(r.swa) > w:
                freed.append(r.swa.popleft())
        if freed and self.swa_account is not None:
            self.swa_account.count_evicted(len(freed), window=True)
        return freed

    def _decode(self, freed: list[int]) -> None:
        batch = [r for r in self.running if r.generated < r.output]
        if not batch:
            return
        try:
            ids = self.pool.alloc(len(batch)).tolist()
        except CapacityError:
            self.counts["decode_stalls"] += 1
            return
        for r, slot in zip(batch, ids, strict=True):
            r.swa.append(slot)
            r.generated += 1
        self._grow_rows(batch)
        self.counts["decoded_tokens"] += len(batch)

    def _own_rows(self, r: Request, family: str, tokens: int) -> int:
        """Rows of `family` request `r` holds itself at `tokens` (a hit's prefix rows are
        the cache's)."""
        want = self._rules[family](tokens)
        if r.hit and family in PREFIX_FAMILIES:
            want -= self._rules[family](r.prefix)
        return want

    def _grow_rows(self, requests: list[Request]) -> None:
        for family in self._rules:
            delta = 0
            for r in requests:
                want = self._own_rows(r, family, r.tokens)
                delta += want - r.rows.get(family, 0)
                r.rows[family] = want
            if delta > 0:
                self.accounts[family].occupy(delta)
            elif delta < 0:
                self.accounts[family].release(-delta)

    def _admit(self) -> None:
        cfg = self.config
        if not self.waiting or len(self.running) >= cfg.max_running:
            return
        r = self.waiting[0]
        entry = self.cache.get(r.prefix_id) if r.prefix_id is not None else None
        r.hit = entry is not None
        final = {f: self._own_rows(r, f, r.prompt + r.output) for f in self._rules}
        while not self._room(final):
            if not self._evict_one(keep=r.prefix_id):
                self.counts["admission_waits"] += 1
                r.hit = False
                return
        try:
            ids = self.pool.alloc(r.prompt).tolist()
        except CapacityError:
            self.counts["admission_waits"] += 1
            r.hit = False
            self._evict_one(keep=r.prefix_id)  # SWA room for the next try
            return
        self.waiting.popleft()
        if entry is not None:
            entry.locks += 1
            entry.last_used = self.clock
            self.counts["prefix_hits"] += 1
        r.swa.extend(ids)
        for f, need in final.items():
            self._committed[f] += need
        self._grow_rows([r])
        self.running.append(r)
        self.counts["admitted"] += 1
        self.counts["prefilled_tokens"] += r.prompt

    def _cached_rows(self, family: str) -> int:
        return sum(e.rows.get(family, 0) for e in self.cache.values())

    def _room(self, final: Mapping[str, int]) -> bool:
        return all(
            self._committed[f] + self._cached_rows(f) + need <= self.accounts[f].capacity_slots
            for f, need in final.items()
        )

    def _evict_one(self, keep: int | None = None) -> bool:
        """Evict the least recently used unlocked cached prefix (not `keep`); False if none."""
        free = [(e.last_used, k) for k, e in self.cache.items() if not e.locks and k != keep]
        if not free:
            return False
        _, k = min(free)
        entry = self.cache.pop(k)
        if entry.swa:
            with contextlib.suppress(Exception):  # a pool already closed freed them itself
                self.pool.free(entry.swa)
            if self.swa_account is not None:
                self.swa_account.count_evicted(len(entry.swa))
        for f, rows in entry.rows.items():
            if rows:
                self.accounts[f].release(rows)
                count = getattr(self.accounts[f], "count_evicted", None)
                if count is not None:
                    count(rows)
        self.counts["prefix_evictions"] += 1
        return True

    def _finish(self, freed: list[int]) -> None:
        done = [r for r in self.running if r.generated >= r.output]
        for r in done:
            self.running.remove(r)
            self._drop(r, freed, cache=True)
            self.counts["finished"] += 1

    def _drop(self, r: Request, freed: list[int], *, cache: bool = False) -> None:
        freed.extend(r.swa)
        r.swa.clear()
        final = {f: self._own_rows(r, f, r.prompt + r.output) for f in self._rules}
        keep: dict[str, int] = {}
        if r.hit:
            entry = self.cache.get(r.prefix_id) if r.prefix_id is not None else None
            if entry is not None:
                entry.locks -= 1
        elif (
            cache
            and r.prefix_id is not None
            and self.config.cache_prefixes
            and r.prefix_id not in self.cache
        ):  # its prefix rows stay, cached
            keep = {f: self._rules[f](r.prefix) for f in PREFIX_FAMILIES if f in self._rules}
            try:  # the tree keeps the SWA entries of the prefix's last window
                swa = self.pool.alloc(min(self.config.window, r.prefix)).tolist()
            except CapacityError:
                swa = []
            self.cache[r.prefix_id] = CachedPrefix(r.prefix, keep, 0, self.clock, swa)
        for f, held in r.rows.items():
            give = held - keep.get(f, 0)
            if give:
                self.accounts[f].release(give)
            self._committed[f] -= final[f]
        r.rows.clear()
        r.hit = False
        while len(self.cache) > self.config.cache_prefixes and self._evict_one():
            pass

    def _publish_holders(self) -> None:
        """Every account's holders and the requests' footprints, as of this step."""
        for f, account in self.accounts.items():
            setter = getattr(account, "set_holders", None)
            if setter is None:
                continue
            locked = sum(e.rows.get(f, 0) for e in self.cache.values() if e.locks)
            setter(locked, self._cached_rows(f) - locked)
        if self.swa_account is not None:
            locked = sum(len(e.swa) for e in self.cache.values() if e.locks)
            cached = sum(len(e.swa) for e in self.cache.values())
            self.swa_account.set_holders(locked, cached - locked)
        per_slot = {
            f: sum(b.slot_bytes for b in getattr(a, "buffers", ()))
            for f, a in {**self.accounts, "swa_kv": self.swa_account}.items()
            if a is not None
        }
        requests = []
        for r in self.running:
            by = {f: rows * per_slot.get(f, 0) for f, rows in r.rows.items()}
            if "swa_kv" in per_slot:
                by["swa_kv"] = len(r.swa) * per_slot["swa_kv"]
            requests.append(
                RequestHeld(f"demo-{r.rid}", r.tokens, self.clock - r.arrived, sum(by.values()), by)
            )
        self._state = engine_state(
            holders_from="kvledger demo workload (a simulated prefix cache)",
            requests=requests,
        )

    def engine_state(self) -> EngineState:
        """The requests' footprints as of the last step (no lock: the ledger may call it
        under its own)."""
        return self._state

    # -- state ------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "running": len(self.running),
                "waiting": len(self.waiting),
                "swa_slots": sum(len(r.swa) for r in self.running),
                **self.counts,
            }

    # -- thread and lifetime ---------------------------------------------------------------
    def start(self) -> Workload:
        if self._thread is not None:
            raise RuntimeError("workload already started")
        self._thread = threading.Thread(target=self._run, name="kvledger-workload", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        logged, held = -LOG_EVERY_S, 0
        while not self._stop.wait(self.config.step_seconds):
            try:
                self.step()
            except Exception as e:
                # Failing every step (a pool at the file-size limit) must not fill the log:
                # the first failure with its traceback, then one line a minute at most.
                self.counts["errors"] += 1
                now = time.monotonic()
                if now - logged < LOG_EVERY_S:
                    held += 1
                    continue
                more = f" ({held} more since the last line)" if held else ""
                log.error(
                    "workload step failed%s; continuing: %s: %s",
                    more,
                    type(e).__name__,
                    e,
                    exc_info=e if logged < 0 else None,
                )
                logged, held = now, 0

    def close(self) -> None:
        """Stop stepping and free every slot and row still held. Idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            freed: list[int] = []
            for r in self.running:
                self._drop(r, freed)
            self.running.clear()
            self.waiting.clear()
            while self._evict_one():
                pass
            self._publish_holders()
            if freed:
                with contextlib.suppress(Exception):  # a pool already closed freed them itself
                    self.pool.free(freed)

    def __enter__(self) -> Workload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
