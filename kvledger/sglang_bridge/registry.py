"""The pool's families in the ledger, through `accounting.inventory`.

`accounting.inventory.register_pool` registers every family of a pool as
runtime-owned. When the bridge owns the SWA KV buffers it registers the
`swa_kv` family itself (VMM-owned, fed by the VMM pool's events), so this
registers the inventory's other families the same way `register_pool` does
(one account per family, keyed `<pool>/<family>`, capacity the largest
buffer's), leaving out the families named in `exclude`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from accounting.inventory import inventory
from accounting.ledger import Account, Ledger


def register_runtime(
    pool: Any, ledger: Ledger, *, pool_name: str, exclude: Iterable[str] = ()
) -> list[Account]:
    """One runtime-owned account per family of `pool` but those in `exclude`; all or nothing."""
    skip = set(exclude)
    added: list[Account] = []
    try:
        for family, specs in inventory(pool, name=pool_name).families().items():
            if family in skip:
                continue
            capacity = max(s.capacity_slots for s in specs)
            added.append(
                ledger.add_account(specs, key=f"{pool_name}/{family}", capacity_slots=capacity)
            )
    except BaseException:
        for account in added:
            ledger.remove_account(account)
        raise
    return added
