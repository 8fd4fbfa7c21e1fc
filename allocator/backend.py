"""The one interface every VMM backend implements (CUDA driver, host memfd).

Semantics, mirrored by both backends:
- `reserve(size)` takes virtual address space only; touching it faults.
- `create(size)` commits physical memory at once and returns a handle;
  `release(handle)` gives it back (deferred until its last mapping goes).
- `map(address, size, handle)` places a handle at an address inside a
  reservation; the range stays inaccessible until `set_access`.
- `unmap(address, size)` returns the range to reserved-but-inaccessible. It does not wait
  for device work still queued on the range (on CUDA that work then faults the context):
  whoever unmaps waits first (docs/allocator.md#the-cuda-fence-rule).
- `synchronize()` waits until every device operation this process has queued so far, on
  any stream, has completed (host: returns at once). Optional: a backend without it has no
  queued device work.
All sizes and addresses are multiples of `granularity`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

# The CUDA VMM granularity measured on an H200 (docs/background.md#cuda-driver-facts): the
# host backend's default page, and the planners' when no device is at hand.
DEFAULT_GRANULARITY = 2 << 20


class Backend(Protocol):
    name: str
    granularity: int

    def reserve(self, size: int) -> int: ...
    def free_reservation(self, address: int, size: int) -> None: ...
    def create(self, size: int) -> int: ...
    def release(self, handle: int) -> None: ...
    def map(self, address: int, size: int, handle: int) -> None: ...
    def unmap(self, address: int, size: int) -> None: ...
    def set_access(self, address: int, size: int) -> None: ...
    def byte_tensor(self, address: int, size: int) -> Any:
        """A 1-D uint8 torch tensor over [address, address + size), on this backend's device."""
        ...

    def synchronize(self) -> None:
        """Wait for every device operation queued so far, on any stream (host: none)."""
        ...

    def close(self) -> None: ...


def check_aligned(op: str, granularity: int, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 0 or value % granularity:
            raise ValueError(
                f"{op}: {name}={value!r}, expected a non-negative multiple of the "
                f"granularity {granularity}"
            )


def backend_stats(
    reservations: dict[int, int], handle_sizes: Iterable[int], mappings: int
) -> dict[str, int]:
    """What a backend holds (both backends' `stats()`): reservations and their bytes,
    handles and their bytes, mappings."""
    sizes = list(handle_sizes)
    return {
        "reservations": len(reservations),
        "reserved_bytes": sum(reservations.values()),
        "handles": len(sizes),
        "handle_bytes": sum(sizes),
        "mappings": mappings,
    }
