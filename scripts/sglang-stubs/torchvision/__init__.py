"""A stand-in for torchvision, installed by scripts/test-sglang into .venv-sglang only.

PyPI's torchvision wheel links CUDA libraries and fails to import on a CPU-only
machine, yet SGLang's package imports reach it at module level (image
processors). KV pools never use it: any `torchvision.*` submodule imports as an
empty module whose attributes are placeholders that raise when used.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+kvledger.stub"


class _Placeholder:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Placeholder:
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name}: torchvision is stubbed in this venv (kvledger tests)")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


def _module_getattr(modname: str):
    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{modname}.{attr}")

    return __getattr__


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__dict__["__getattr__"] = _module_getattr(spec.name)  # PEP 562 module hook
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.insert(0, _StubFinder())
__getattr__ = _module_getattr(__name__)
