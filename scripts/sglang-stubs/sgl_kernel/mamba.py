"""Stand-in `sgl_kernel.mamba`: the names SGLang 0.5.23 imports from it (see the package)."""

from sgl_kernel._unavailable import define

NAMES = (
    "causal_conv1d_fn_cpu",
    "causal_conv1d_update_cpu",
    "chunk_gated_delta_rule_cpu",
)
define(globals(), __name__, NAMES)
del define
