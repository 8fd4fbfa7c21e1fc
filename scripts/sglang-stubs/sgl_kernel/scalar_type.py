"""Stand-in `sgl_kernel.scalar_type`: the names SGLang 0.5.23 imports from it (see the package)."""

from sgl_kernel._unavailable import define

NAMES = (
    "ScalarType",
    "scalar_types",
)
define(globals(), __name__, NAMES)
del define
