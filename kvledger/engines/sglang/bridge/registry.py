"""The pool's families in the ledger, through `kvledger.engines.sglang.inventory`.

`kvledger.engines.sglang.inventory.register_pool` registers every family of a pool as
runtime-owned. When the bridge owns the SWA KV buffers it registers the
`swa_kv` family itself (VMM-owned, fed by the VMM pool's events), so this
registers the inventory's other families through `register_pool`, leaving out
the families named in `exclude`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from accounting.ledger import Account, Ledger
from kvledger.engines.sglang.inventory import register_pool


def register_runtime(
    pool: Any, ledger: Ledger, *, pool_name: str, exclude: Iterable[str] = ()
) -> list[Account]:
    """One runtime-owned account per family of `pool` but those in `exclude`; all or nothing."""
    return list(register_pool(ledger, pool, name=pool_name, exclude=exclude).accounts)
