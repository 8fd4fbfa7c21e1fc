"""The labels SGLang 0.5.23 puts on its scheduler metrics, read from its runtime context.

SGLang builds them in `SchedulerMetricsCollector`'s factory
(`sglang/srt/observability/metrics_collector.py`):

    model_name   the served model name
    engine_type  "unified", "prefill" or "decode" (the PD disaggregation mode), or
                 "dynamic" when PD role switching is on
    tp_rank, pp_rank, moe_ep_rank
    dp_rank      only when the process has a DP rank
    ...          the operator's `--extra-metric-labels`

`priority=""` (added there when priority scheduling is on) is left out: an empty label
value is the same series as an absent label in Prometheus. Read at pool-build time, once
SGLang has published the scheduler's context (after `load_plugins()` has run).
"""

from __future__ import annotations


def scheduler_metric_labels() -> dict[str, str]:
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import (
        get_disagg,
        get_observability,
        get_parallel,
        get_serving,
    )

    parallel = get_parallel()
    disagg = get_disagg()
    engine_type = (
        "dynamic"
        if disagg.enable_pd_role_switch
        else DisaggregationMode.to_engine_type(disagg.disaggregation_mode)
    )
    labels = {
        "model_name": str(get_serving().served_model_name),
        "engine_type": engine_type,
        "tp_rank": str(parallel.tp_rank),
        "pp_rank": str(parallel.pp_rank),
        "moe_ep_rank": str(parallel.moe_ep_rank),
    }
    if parallel.dp_rank is not None:
        labels["dp_rank"] = str(parallel.dp_rank)
    extra = get_observability().extra_metric_labels
    if extra:
        labels.update({str(k): str(v) for k, v in dict(extra).items()})
    return labels
