"""Stand-in `sgl_kernel.allreduce`: the names SGLang 0.5.23 imports from it (see the package)."""

from sgl_kernel._unavailable import define

NAMES = (
    "all_reduce",
    "all_reduce_reg",
    "all_reduce_unreg",
    "allocate_meta_buffer",
    "deterministic_all_reduce_reg",
    "deterministic_all_reduce_unreg",
    "dispose",
    "get_graph_buffer_ipc_meta",
    "get_meta_buffer_ipc_handle",
    "init_custom_ar",
    "init_custom_qr",
    "meta_size",
    "qr_all_reduce",
    "qr_destroy",
    "qr_get_handle",
    "qr_max_size",
    "qr_open_handles",
    "register_buffer",
    "register_graph_buffers",
)
define(globals(), __name__, NAMES)
del define
