"""What every name of this stand-in is: a placeholder that raises when called.

`Unavailable("sgl_kernel.silu_and_mul")()` raises NotImplementedError naming
the kernel. Reading an attribute of one gives another (`scalar_types.uint4b8`
at a module's top level still imports); calling any of them raises.
"""

from __future__ import annotations

from typing import Any, NoReturn


class Unavailable:
    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"{self._name}: the real sgl_kernel is not installed here; this is kvledger's "
            "import-only stand-in (scripts/sglang-stubs/sgl_kernel)"
        )

    def __getattr__(self, attr: str) -> Unavailable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Unavailable(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<unavailable {self._name}>"


def define(namespace: dict[str, Any], module: str, names: tuple[str, ...]) -> None:
    for name in names:
        namespace[name] = Unavailable(f"{module}.{name}")
