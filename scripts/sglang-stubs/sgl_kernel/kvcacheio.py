"""Stand-in `sgl_kernel.kvcacheio`: the names SGLang 0.5.23 imports from it (see the package)."""

from sgl_kernel._unavailable import define

NAMES = (
    "get_device_accessible_ptr",
    "transfer_embedding_ranges_direct",
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
)
define(globals(), __name__, NAMES)
del define
