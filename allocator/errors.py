"""kvledger's allocator exceptions.

KvAllocatorError
 ├── DriverError          a backend call failed: operation, address, driver error name
 ├── CapacityError        an allocation cannot be met (slots or physical budget); nothing changed
 ├── SlotError            double free, foreign or out-of-range slot ids; nothing changed
 ├── IncompatibleError    a pool shape the VMM path cannot serve (see allocator.activation)
 └── ClosedError          the pool or backend was used after close()
"""

from __future__ import annotations


class KvAllocatorError(RuntimeError):
    pass


class DriverError(KvAllocatorError):
    def __init__(
        self, op: str, error_name: str, detail: str = "", address: int | None = None
    ) -> None:
        self.op = op
        self.error_name = error_name
        self.address = address
        where = f" at 0x{address:x}" if address is not None else ""
        msg = f"{op}{where} failed: {error_name}"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)


class CapacityError(KvAllocatorError):
    pass


class SlotError(KvAllocatorError, ValueError):
    pass


class IncompatibleError(KvAllocatorError, ValueError):
    pass


class ClosedError(KvAllocatorError):
    pass
