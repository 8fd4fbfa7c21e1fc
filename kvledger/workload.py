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
- A finished request frees everything it held.

`close()` stops the thread and frees every slot and row still held, so the
ledger's occupied figures return to zero.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import random
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from allocator.errors import CapacityError

log = logging.getLogger(__name__)


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


@dataclass
class Request:
    rid: int
    prompt: int
    output: int
    generated: int = 0
    swa: collections.deque[int] = field(default_factory=collections.deque)
    rows: dict[str, int] = field(default_factory=dict)

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

    def _arrivals(self) -> None:
        cfg = self.config
        while self._next_arrival <= self.clock:
            self._next_arrival += self._rng.expovariate(cfg.rate)
            if len(self.waiting) >= cfg.max_waiting:
                self.counts["rejected"] += 1
                continue
            self.waiting.append(
                Request(
                    rid=self._next_id,
                    prompt=self._rng.randint(*cfg.prompt_tokens),
                    output=self._rng.randint(*cfg.output_tokens),
                )
            )
            self._next_id += 1
            self.counts["arrived"] += 1

    def _trim_windows(self) -> list[int]:
        freed: list[int] = []
        w = self.config.window
        for r in self.running:
            while len(r.swa) > w:
                freed.append(r.swa.popleft())
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

    def _grow_rows(self, requests: list[Request]) -> None:
        for family, rule in self._rules.items():
            delta = 0
            for r in requests:
                want = rule(r.tokens)
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
        final = {f: rule(r.prompt + r.output) for f, rule in self._rules.items()}
        for f, need in final.items():
            if self._committed[f] + need > self.accounts[f].capacity_slots:
                self.counts["admission_waits"] += 1
                return
        try:
            ids = self.pool.alloc(r.prompt).tolist()
        except CapacityError:
            self.counts["admission_waits"] += 1
            return
        self.waiting.popleft()
        r.swa.extend(ids)
        for f, need in final.items():
            self._committed[f] += need
        self._grow_rows([r])
        self.running.append(r)
        self.counts["admitted"] += 1
        self.counts["prefilled_tokens"] += r.prompt

    def _finish(self, freed: list[int]) -> None:
        done = [r for r in self.running if r.generated >= r.output]
        for r in done:
            self.running.remove(r)
            self._drop(r, freed)
            self.counts["finished"] += 1

    def _drop(self, r: Request, freed: list[int]) -> None:
        freed.extend(r.swa)
        r.swa.clear()
        final = {f: rule(r.prompt + r.output) for f, rule in self._rules.items()}
        for f, held in r.rows.items():
            if held:
                self.accounts[f].release(held)
            self._committed[f] -= final[f]
        r.rows.clear()

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
        while not self._stop.wait(self.config.step_seconds):
            try:
                self.step()
            except Exception:
                self.counts["errors"] += 1
                log.exception("workload step failed; continuing")

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
            if freed:
                with contextlib.suppress(Exception):  # a pool already closed freed them itself
                    self.pool.free(freed)

    def __enter__(self) -> Workload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
