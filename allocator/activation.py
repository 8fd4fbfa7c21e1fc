"""Opt-in activation of the VMM path, with a `require` switch (as in kvcached's SGLang bridge).

Nothing changes unless asked: with the VMM path off, or on with an incompatible
shape, the caller gets ordinary tensors (`NativeSwaBuffers`). With `require`
on, an incompatible shape fails at start with the reason instead.

    KVLEDGER_VMM=1           use the VMM pool for the SWA buffers
    KVLEDGER_VMM_REQUIRE=1   fail start-up rather than fall back
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from accounting.switches import switch
from allocator.backend import Backend
from allocator.errors import IncompatibleError, KvAllocatorError
from allocator.slots.layout import SlotLayout
from allocator.slots.pool import SwaPool

log = logging.getLogger(__name__)

ENV_ENABLE = "KVLEDGER_VMM"
ENV_REQUIRE = "KVLEDGER_VMM_REQUIRE"


@dataclass(frozen=True)
class Activation:
    enabled: bool = False
    require: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Activation:
        """The two switches (accounting.switches) from `env`, default os.environ."""
        return cls(enabled=switch(ENV_ENABLE, env), require=switch(ENV_REQUIRE, env))


def incompatibilities(layout: SlotLayout, *, granularity: int, element_size: int) -> list[str]:
    """Why this layout cannot be served by the VMM pool; empty when it can."""
    reasons = []
    if layout.page_bytes % granularity:
        reasons.append(
            f"page_bytes={layout.page_bytes} is not a multiple of the granularity {granularity}"
        )
    if layout.slot_bytes > layout.page_bytes:
        reasons.append(f"slot_bytes={layout.slot_bytes} exceeds page_bytes={layout.page_bytes}")
    if element_size <= 0 or layout.row_bytes % element_size:
        reasons.append(
            f"row_bytes={layout.row_bytes} is not a whole number of {element_size}-byte elements"
        )
    return reasons


class NativeSwaBuffers:
    """Ordinary per-layer tensors: what the engine would have had without kvledger."""

    pool = None

    def __init__(self, layers: int, layout: SlotLayout, *, device: str, reason: str) -> None:
        import torch

        self.reason = reason
        self.tensors = [
            torch.zeros(layout.rows * layout.row_bytes, dtype=torch.uint8, device=device)
            for _ in range(layers)
        ]

    def close(self) -> None:
        self.tensors = []


class VmmSwaBuffers:
    """The SWA buffers on a VMM pool; owns the pool and the backend made for it."""

    def __init__(self, pool: SwaPool, backend: Backend) -> None:
        self.pool = pool
        self.backend = backend
        self.reason = ""
        self.tensors = pool.tensors

    def close(self) -> None:
        self.tensors = []
        try:
            self.pool.close()
        finally:
            self.backend.close()


def build_swa_buffers(
    *,
    layers: int,
    layout: SlotLayout,
    backend: Callable[[], Backend],
    activation: Activation | None = None,
    element_size: int = 1,
    device: str = "cpu",
    pool_options: Mapping[str, Any] | None = None,
) -> VmmSwaBuffers | NativeSwaBuffers:
    """The SWA buffers: on the VMM pool when enabled and compatible, else ordinary tensors."""
    activation = activation or Activation.from_env()
    if not activation.enabled:
        return NativeSwaBuffers(
            layers, layout, device=device, reason=f"VMM path off (set {ENV_ENABLE}=1)"
        )
    try:
        be = backend()
    except (KvAllocatorError, ImportError, OSError) as e:
        return _refuse(activation, layers, layout, device, f"no VMM backend: {e}")
    reasons = incompatibilities(layout, granularity=be.granularity, element_size=element_size)
    if reasons:
        be.close()
        return _refuse(activation, layers, layout, device, "; ".join(reasons))
    try:
        pool = SwaPool(be, layers=layers, layout=layout, **dict(pool_options or {}))
    except BaseException:
        be.close()
        raise
    return VmmSwaBuffers(pool, be)


def _refuse(
    activation: Activation, layers: int, layout: SlotLayout, device: str, reason: str
) -> NativeSwaBuffers:
    if activation.require:
        raise IncompatibleError(f"VMM SWA pool required ({ENV_REQUIRE}=1) but unusable: {reason}")
    log.warning("kvledger: VMM SWA pool not used, keeping ordinary tensors: %s", reason)
    return NativeSwaBuffers(layers, layout, device=device, reason=reason)
