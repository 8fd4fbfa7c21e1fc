"""Every engine export kvledger has, registered with the exporter (`exporter.engines`).

SGLang's sources are in the exporter's own shape and need none; vLLM's are registered here.
`kvledger serve` and the dashboards generator call `register_all()` before they read the
exporter's metric table; it is idempotent.
"""

from __future__ import annotations

from exporter import engines


def register_all() -> None:
    from kvledger.engines.vllm.export import EXPORT as VLLM

    engines.register(VLLM)
