"""Stand-in `sgl_kernel.elementwise`: the names SGLang 0.5.23 imports from it (see the package)."""

from sgl_kernel._unavailable import define

NAMES = ("copy_to_gpu_no_ce",)
define(globals(), __name__, NAMES)
del define
