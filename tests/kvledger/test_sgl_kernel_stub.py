"""scripts/sglang-stubs/sgl_kernel: the import-only stand-in the device runs carry (no real kernels
there). Every name raises when called; with SGLang installed, the stand-in still defines every name
SGLang's source imports from `sgl_kernel`."""

from __future__ import annotations

import ast
import importlib
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

STUBS = Path(__file__).resolve().parents[2] / "scripts" / "sglang-stubs"
SUBMODULES = (
    "allreduce",
    "elementwise",
    "flash_attn",
    "kvcacheio",
    "mamba",
    "quantization",
    "scalar_type",
    "speculative",
    "utils",
)


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    if importlib.util.find_spec("sgl_kernel") is not None and "sgl_kernel" not in sys.modules:
        origin = importlib.util.find_spec("sgl_kernel").origin  # type: ignore[union-attr]
        if origin and not origin.startswith(str(STUBS)):
            pytest.skip(f"a real sgl_kernel is installed ({origin})")
    monkeypatch.syspath_prepend(str(STUBS))
    for name in [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]:
        monkeypatch.delitem(sys.modules, name)
    mod = importlib.import_module("sgl_kernel")
    yield mod
    for name in [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]:
        del sys.modules[name]


def _modules(stub: object) -> dict[str, object]:
    out = {"sgl_kernel": stub}
    for sub in SUBMODULES:
        out[f"sgl_kernel.{sub}"] = importlib.import_module(f"sgl_kernel.{sub}")
    return out


def test_every_name_raises_not_implemented_naming_itself(stub: object) -> None:
    assert Path(stub.__file__).parent.parent == STUBS  # type: ignore[attr-defined]
    assert stub.STAND_IN is True  # type: ignore[attr-defined]
    count = 0
    for module, mod in _modules(stub).items():
        names = mod.NAMES  # type: ignore[attr-defined]
        assert names and len(set(names)) == len(names), module
        for name in names:
            fn = getattr(mod, name)
            with pytest.raises(
                NotImplementedError, match=rf"^{module}\.{name}: the real sgl_kernel"
            ):
                fn(1, key=2)
            count += 1
    assert count > 100
    # Attribute chains read at import time (`scalar_types.uint4b8`) resolve; calls still raise.
    scalar_types = importlib.import_module("sgl_kernel.scalar_type").scalar_types

    with pytest.raises(NotImplementedError, match=r"scalar_types\.uint4b8\.size"):
        scalar_types.uint4b8.size()


def test_a_name_sglang_does_not_import_is_missing(stub: object) -> None:
    assert not hasattr(stub, "no_such_kernel")
    with pytest.raises(ImportError):
        exec("from sgl_kernel import no_such_kernel", {})


def _sglang_imports(root: Path) -> tuple[dict[str, set[str]], set[str]]:
    """(module -> names imported from it, submodules imported or dereferenced) over SGLang's
    source: `from sgl_kernel[.x] import n`, `import sgl_kernel[.x]` and `sgl_kernel.x.n`."""
    names: dict[str, set[str]] = {}
    modules: set[str] = set()
    for path in root.rglob("*.py"):
        try:
            text = path.read_text(encoding="utf-8")
            if "sgl_kernel" not in text:
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # SGLang's own invalid escapes
                tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError):
            continue
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module == "sgl_kernel" or node.module.startswith("sgl_kernel."):
                    names.setdefault(node.module, set()).update(a.name for a in node.names)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "sgl_kernel" or a.name.startswith("sgl_kernel."):
                        modules.add(a.name)
                        aliases[a.asname or a.name.split(".")[0]] = (
                            a.name if a.asname else a.name.split(".")[0]
                        )
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                inner = node.value
                if (
                    isinstance(inner.value, ast.Name)
                    and aliases.get(inner.value.id) == "sgl_kernel"
                ):
                    sub = f"sgl_kernel.{inner.attr}"
                    if sub in modules:
                        names.setdefault(sub, set()).add(node.attr)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                target = aliases.get(node.value.id)
                if target == "sgl_kernel" and f"sgl_kernel.{node.attr}" not in modules:
                    names.setdefault("sgl_kernel", set()).add(node.attr)
                elif target is not None and target != "sgl_kernel":
                    names.setdefault(target, set()).add(node.attr)
    return names, modules


@pytest.mark.sglang
def test_the_stand_in_covers_what_sglang_imports(stub: object) -> None:
    import sglang

    names, modules = _sglang_imports(Path(sglang.__file__).parent)
    assert names, "no sgl_kernel import found in SGLang's source: the scan is broken"
    mods = _modules(stub)
    for module in modules | set(names):
        assert module in mods, f"SGLang imports {module}; the stand-in lacks it"
    missing = {
        f"{module}.{n}"
        for module, ns in names.items()
        for n in ns
        if n not in SUBMODULES or module != "sgl_kernel"
        if not hasattr(mods[module], n)
    }
    assert not missing, f"names SGLang imports that the stand-in lacks: {sorted(missing)}"
