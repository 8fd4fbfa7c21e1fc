"""Shared fixtures. GPU tests (marker `gpu`) skip unless a CUDA device and cuda-python are present;
SGLang tests (marker `sglang`) skip unless SGLang imports (scripts/test-sglang runs them);
vLLM tests (marker `vllm`) skip unless vLLM is installed (scripts/test-vllm runs them), and the
vLLM 0.34 tier (marker `vllm034`) unless the installed vLLM is 0.34 (.venv-vllm034)."""

from __future__ import annotations

import functools
import importlib.util

import pytest


@functools.cache
def cuda_available() -> bool:
    if importlib.util.find_spec("cuda") is None:
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


@functools.cache
def sglang_available() -> bool:
    return importlib.util.find_spec("sglang") is not None


@functools.cache
def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


@functools.cache
def vllm034_available() -> bool:
    if not vllm_available():
        return False
    import importlib.metadata

    try:
        return importlib.metadata.version("vllm").startswith("0.34.")
    except importlib.metadata.PackageNotFoundError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU and cuda-python (marker gpu)")
    skip_sglang = pytest.mark.skip(
        reason="needs SGLang 0.5.23: run scripts/test-sglang (marker sglang)"
    )
    skip_vllm = pytest.mark.skip(reason="needs vLLM 0.33.0: run scripts/test-vllm (marker vllm)")
    skip_vllm034 = pytest.mark.skip(
        reason="needs vLLM 0.34.0 (.venv-vllm034): run scripts/test-vllm (marker vllm034)"
    )
    for item in items:
        if item.get_closest_marker("gpu") is not None and not cuda_available():
            item.add_marker(skip_gpu)
        if item.get_closest_marker("sglang") is not None and not sglang_available():
            item.add_marker(skip_sglang)
        if item.get_closest_marker("vllm") is not None and not vllm_available():
            item.add_marker(skip_vllm)
        if item.get_closest_marker("vllm034") is not None and not vllm034_available():
            item.add_marker(skip_vllm034)
