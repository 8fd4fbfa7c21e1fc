"""The embedded default source of `kvledger serve`: a DeepSeek-V4-Flash-shaped pool under a workload.

`DemoSource` builds, in one process:
- a VMM backend (the host memfd backend by default, CUDA with `backend="cuda"`);
- the DeepSeek-V4 buffer map for a byte budget (`kvledger.engines.sglang.dsv4.plan`, SGLang 0.5.23's
  sizing), its seven families registered in a `Ledger`;
- the SWA family on an `allocator.SwaPool` with a `BackgroundMapper`, its ledger
  `Account` as the pool's observer; the six other families as runtime-owned
  accounts over real tensors of the planned shapes and dtypes, on the CPU (host
  backend) or on the GPU (CUDA backend), whose rows the workload occupies and
  releases;
- device truth for reconciliation (host memfd blocks, read with the SWA pool's page store
  held quiescent so that both are of one instant, or NVML);
- a `Publisher` writing the ledger to the snapshot directory, and the built-in
  `Workload`.

On the host backend every byte of the pool is this machine's memory: a budget whose
pool does not fit what the machine (or the process's cgroup) has available is refused
before anything is allocated (`kvledger.demo.hostmem`). The runtime tensors are zeroed in
chunks of `ZERO_CHUNK_BYTES`, with a progress line on the `kvledger.demo.source` logger at
most once a second, so a large pool shows how far it got and a signal is handled
between chunks rather than after the whole pool.

`close()` (idempotent, also on a failure half way) releases them in reverse:
workload (frees every slot and row), publisher (removes its file), mapper, pool
(unmaps and releases everything), backend.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from accounting.buffers import BufferSpec, Owner
from accounting.ledger import Account, Ledger
from accounting.reconcile import host_memfd_truth
from accounting.snapfile.writer import Publisher
from accounting.units import format_size
from allocator import BackgroundMapper, HostBackend, SlotLayout, SwaPool
from kvledger.demo import hostmem
from kvledger.demo.workload import Workload, WorkloadConfig
from kvledger.engines.sglang.dsv4 import Knobs, load_config, plan
from kvledger.engines.sglang.dsv4.buffermap import BufferMap

CONFIG_RESOURCE = "deepseek-v4-flash-shape.config.json"
DEFAULT_BUDGET = 512 << 20
DEFAULT_MAX_RUNNING = 8
DEFAULT_CONTEXT_LENGTH = 8192
# The host backend's page for the demo: small, so a laptop-sized SWA pool has enough pages
# for mapping and unmapping to show (CUDA uses the device's granularity, 2 MiB on an H200).
DEFAULT_HOST_GRANULARITY = 256 << 10
# The SWA pool's spare pages per layer (SwaPool's min_spare_pages / max_spare_pages).
MIN_SPARE_PAGES = 1
MAX_SPARE_PAGES = 2
ZERO_CHUNK_BYTES = 64 << 20
PROGRESS_EVERY_S = 1.0

log = logging.getLogger("kvledger.demo.source")


def default_config_path() -> str:
    """The DeepSeek-V4-Flash-shaped config shipped as package data."""
    return str(importlib.resources.files("kvledger") / "data" / CONFIG_RESOURCE)


@dataclass(frozen=True)
class DemoOptions:
    config_path: str | None = None
    budget_bytes: int = DEFAULT_BUDGET
    backend: str = "host"
    device: int = 0
    host_granularity: int = DEFAULT_HOST_GRANULARITY
    max_running_requests: int = DEFAULT_MAX_RUNNING
    context_length: int = DEFAULT_CONTEXT_LENGTH
    labels: Mapping[str, str] | None = None
    snapshot_dir: str | None = None
    snapshot_dir_group_writable: bool = False
    publish_interval: float = 1.0
    workload: WorkloadConfig | None = None
    start_workload: bool = True


class DemoSource:
    def __init__(self, options: DemoOptions) -> None:
        self.options = options
        self._stack = contextlib.ExitStack()
        self._closed = False
        try:
            self._build(options)
        except BaseException:
            self._stack.close()
            raise

    def _build(self, o: DemoOptions) -> None:
        if o.backend not in ("host", "cuda"):
            raise ValueError(f"backend={o.backend!r}, expected 'host' or 'cuda'")
        shape = load_config(o.config_path or default_config_path())
        knobs = Knobs(max_running_requests=o.max_running_requests, context_length=o.context_length)
        self.buffer_map: BufferMap = plan(shape, knobs, budget_bytes=o.budget_bytes)
        self.ledger = Ledger(o.labels or {})
        self.backend = self._open_backend(o)
        self.accounts: dict[str, Account] = {}
        specs = self.buffer_map.specs(
            pool="dsv4", owner_of={"swa_kv": Owner.VMM}, granularity=self.backend.granularity
        )
        if o.backend == "host":
            _check_fits(o.budget_bytes, host_bytes(specs, self.backend.granularity))
        by_family: dict[str, list[BufferSpec]] = {}
        for s in specs:
            by_family.setdefault(s.family, []).append(s)
        self.pool = self._swa_pool(by_family.pop("swa_kv"))
        if o.backend == "host":
            # Held quiescent across the ledger's copy and the memfd read: the background
            # mapper makes a page id's handle set (a granule per layer) and maps it off the
            # store's lock, so a truth read at once could land between the two and see the
            # memfd up to a page id ahead of the ledger (accounting.reconcile.HostMemfdTruth).
            self.ledger.add_truth(
                host_memfd_truth(self.backend.physical_bytes, self.pool.store.quiescent)
            )
        self.mapper = BackgroundMapper(self.pool)
        self._stack.callback(self.mapper.close)
        self.runtime_tensors = self._runtime_tensors(o, by_family)
        self._stack.callback(self.runtime_tensors.clear)
        for family, fspecs in by_family.items():
            usable = self.buffer_map.families[family].usable_slots
            self.accounts[family] = self.ledger.add_account(fspecs, capacity_slots=usable)
        self.publisher: Publisher | None = None
        if o.snapshot_dir is not None:
            self.publisher = Publisher(
                self.ledger,
                o.snapshot_dir,
                interval=o.publish_interval,
                group_writable=o.snapshot_dir_group_writable,
            )
            self._stack.callback(self.publisher.close)
        cfg = o.workload or WorkloadConfig(max_running=o.max_running_requests)
        self.workload = Workload(self.pool, self.accounts, cfg)
        self._stack.callback(self.workload.close)
        self.ledger.set_engine_state(self.workload.engine_state)
        self._stack.callback(self.ledger.set_engine_state, None)
        if o.start_workload:
            self.workload.start()

    def _runtime_tensors(
        self, o: DemoOptions, by_family: Mapping[str, list[BufferSpec]]
    ) -> dict[str, Any]:
        """The runtime-owned buffers as the engine would hold them: real tensors, so their
        storage is memory the device (and torch's reserved bytes) really holds."""
        import torch

        device = f"cuda:{o.device}" if o.backend == "cuda" else "cpu"
        total = sum(s.tensor_bytes for specs in by_family.values() for s in specs)
        progress = _Progress(f"runtime tensors ({device})", total)
        out: dict[str, Any] = {}
        for specs in by_family.values():
            for spec in specs:
                t = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=device)
                got = t.numel() * t.element_size()
                if got != spec.tensor_bytes:
                    raise ValueError(
                        f"buffer {spec.name!r}: a {spec.dtype} tensor of {spec.shape} is {got} bytes, the plan says {spec.tensor_bytes}"
                    )
                # Zeroed chunk by chunk: the pages become the process's memory as the engine's
                # would, and a signal is handled between chunks.
                flat = t.view(-1)
                step = max(ZERO_CHUNK_BYTES // max(t.element_size(), 1), 1)
                for start in range(0, flat.numel(), step):
                    chunk = flat[start : start + step]
                    chunk.zero_()
                    progress.add(chunk.numel() * t.element_size())
                out[spec.name] = t
        progress.done()
        return out

    def _open_backend(self, o: DemoOptions) -> Any:
        if o.backend == "cuda":
            try:
                from accounting.nvml import nvml_truth
                from accounting.torch_memory import CudaTorchMemory
                from allocator.cuda import CudaBackend
            except ImportError as e:
                raise ValueError(f"backend='cuda' is not available here: {e}") from e
            import torch

            # NVML's baseline is taken once the CUDA context and torch's kernels are loaded
            # (they are the process's, not the KV cache's) and before any pool memory exists.
            torch.cuda.init()
            torch.ones(1, device=f"cuda:{o.device}").add_(1).item()
            torch.cuda.synchronize(o.device)
            torch.cuda.empty_cache()  # torch's reserved bytes then start at 0 with the baseline
            # split into the GPU's parts too (accounting.gpu_parts; the demo has no model,
            # so no weights)
            truth = nvml_truth(o.device, torch_memory=CudaTorchMemory(o.device))
            backend: Any = self._stack.enter_context(CudaBackend(o.device))
            self.ledger.add_truth(truth)
        else:
            # its truth is added with the SWA pool, whose store it holds quiescent (_build)
            backend = self._stack.enter_context(HostBackend(o.host_granularity))
        return backend

    def _swa_pool(self, specs: list[BufferSpec]) -> SwaPool:
        first = self.buffer_map.family_buffers("swa_kv")[0]
        layout = SlotLayout(
            capacity_slots=first.capacity_slots,
            slot_bytes=first.slot_bytes,
            page_bytes=self.backend.granularity,
            slots_per_row=first.slots_per_row,
            row_bytes=first.row_bytes,
        )
        account = self.ledger.add_account(
            specs,
            page_bytes=layout.page_bytes,
            capacity_slots=layout.capacity_slots - 1,  # slot 0 is the pool's null slot
        )
        self.accounts["swa_kv"] = account
        pool = SwaPool(
            self.backend,
            layers=len(specs),
            layout=layout,
            min_spare_pages=MIN_SPARE_PAGES,
            max_spare_pages=MAX_SPARE_PAGES,
            observer=account,
            name="swa",
        )
        self._stack.callback(pool.close)
        return pool

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop the workload and release everything in reverse order. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stack.close()

    def __enter__(self) -> DemoSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def host_bytes(specs: list[BufferSpec], page_bytes: int) -> int:
    """Memory the demo's pool can hold on the host backend: every runtime tensor's storage,
    and the VMM family's whole reservation plus its spare pages."""
    vmm_layers = sum(1 for s in specs if s.owner is Owner.VMM)
    return sum(s.reserved_bytes for s in specs) + vmm_layers * MAX_SPARE_PAGES * page_bytes


def _check_fits(budget: int, need: int) -> None:
    room = hostmem.available()
    if room is not None and need > room.bytes:
        raise ValueError(
            f"budget {format_size(budget)} does not fit this machine's available memory: the "
            f"host backend holds its pool, {format_size(need)}, in RAM and "
            f"{format_size(room.bytes)} is available ({room.source}); expected a budget whose "
            "pool fits (a smaller --budget)"
        )


class _Progress:
    """Progress of a long build on the `kvledger.demo.source` logger: a line at the start, at most
    one a second, and one at the end."""

    def __init__(self, what: str, total: int) -> None:
        self.what = what
        self.total = total
        self.done_bytes = 0
        self.started = time.monotonic()
        self._next = self.started + PROGRESS_EVERY_S
        log.info("building the demo pool: %s, %s", what, format_size(total))

    def add(self, n: int) -> None:
        self.done_bytes += n
        now = time.monotonic()
        if now >= self._next:
            self._next = now + PROGRESS_EVERY_S
            log.info(
                "building the demo pool: %s %s of %s (%.0f%%)",
                self.what,
                format_size(self.done_bytes),
                format_size(self.total),
                100.0 * self.done_bytes / max(self.total, 1),
            )

    def done(self) -> None:
        log.info(
            "built the demo pool: %s, %s in %.1f s",
            self.what,
            format_size(self.done_bytes),
            time.monotonic() - self.started,
        )
