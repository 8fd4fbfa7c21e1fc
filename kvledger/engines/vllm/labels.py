"""The labels a kvledger file from a vLLM process carries.

vLLM 0.33 labels its metrics `model_name` (the served model name) and `engine` (the
engine index: `vllm/v1/metrics/loggers.py`, `PrometheusStatLogger`); an engine's index is
its data-parallel rank (`parallel_config.data_parallel_rank`, 0 without DP). kvledger
adds what tells the files of one engine apart:

    model_name   the served model name (the first, when vLLM serves it under several)
    engine       the engine index (the DP rank), as vLLM's own metrics carry it
    dp_rank      the same number, where kvledger's exporter keys a source by it
    engine_type  `vllm_worker` (a worker: the tensors) or `vllm_scheduler` (the engine
                 core: the occupancy), so the two files of one engine never claim the
                 same engine key in `kvledger serve`
    tp_rank, pp_rank   a worker's ranks in its engine (workers only)
"""

from __future__ import annotations

from typing import Any

WORKER = "vllm_worker"
SCHEDULER = "vllm_scheduler"


def model_name(vllm_config: Any) -> str:
    name = getattr(vllm_config.model_config, "served_model_name", None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return str(name or getattr(vllm_config.model_config, "model", "unknown"))


def engine_index(vllm_config: Any) -> int:
    return int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)


def _engine_labels(vllm_config: Any, role: str) -> dict[str, str]:
    engine = str(engine_index(vllm_config))
    return {
        "model_name": model_name(vllm_config),
        "engine": engine,
        "dp_rank": engine,
        "engine_type": role,
    }


def scheduler_labels(vllm_config: Any) -> dict[str, str]:
    return _engine_labels(vllm_config, SCHEDULER)


def worker_labels(vllm_config: Any, tp_rank: int, pp_rank: int) -> dict[str, str]:
    return {**_engine_labels(vllm_config, WORKER), "tp_rank": str(tp_rank), "pp_rank": str(pp_rank)}


def worker_ranks() -> tuple[int, int]:
    """(tp rank, pp rank) of this worker from vLLM's parallel state; (0, 0) before it exists."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return int(get_tp_group().rank_in_group), int(get_pp_group().rank_in_group)
    except Exception:
        return 0, 0
