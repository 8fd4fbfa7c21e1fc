"""Stand-in `sgl_kernel.quantization`: the names SGLang 0.5.23 imports from it (see the package)."""

from sgl_kernel._unavailable import define

NAMES = (
    "ggml_dequantize",
    "ggml_moe_a8",
    "ggml_moe_a8_vec",
    "ggml_mul_mat_a8",
    "ggml_mul_mat_vec_a8",
)
define(globals(), __name__, NAMES)
del define
