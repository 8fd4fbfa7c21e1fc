"""Yes/no environment switches: the one reading of them, for every layer.

A switch is off when unset, empty or one of 0/false/no/off, on when one of 1/true/yes/on
(case and surrounding blanks ignored); anything else is an error naming the variable and
its value, never a silent "off" (a mistyped `..._REQUIRE` must not drop a requirement).

The standard library only, and the package's `__init__` imports nothing eagerly, so this is
cheap to import anywhere: SGLang loads kvledger's plugin entry point in every SGLang
process, and it reads `KVLEDGER_SGLANG` through here before anything else.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ON = frozenset({"1", "true", "yes", "on"})
OFF = frozenset({"", "0", "false", "no", "off"})


def switch(name: str, env: Mapping[str, str] | None = None) -> bool:
    """The switch `name` in `env` (default `os.environ`); a value neither on nor off raises
    ValueError naming the variable and the value."""
    raw = (os.environ if env is None else env).get(name, "")
    value = raw.strip().lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    raise ValueError(f"{name}={raw!r}, expected one of 1/0/true/false/yes/no/on/off")
