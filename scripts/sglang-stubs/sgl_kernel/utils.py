"""Stand-in `sgl_kernel.utils`: the names SGLang 0.5.23 imports from it (see the package)."""

from sgl_kernel._unavailable import define

NAMES = ("is_arch_support_pdl",)
define(globals(), __name__, NAMES)
del define
