"""Stand-in `sgl_kernel.flash_attn`: the names SGLang 0.5.23 imports from it (see the package)."""

from sgl_kernel._unavailable import define

NAMES = (
    "build_bidirectional_block_ids",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "get_scheduler_metadata",
)
define(globals(), __name__, NAMES)
del define
