"""Stand-in `sgl_kernel.speculative`: the names SGLang 0.5.23 imports from it (see the package)."""

from sgl_kernel._unavailable import define

NAMES = ("reconstruct_indices_from_tree_mask",)
define(globals(), __name__, NAMES)
del define
