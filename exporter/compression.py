"""gzip for `/metrics` bodies: ISA-L's deflate where it is installed, zlib's otherwise.

Prometheus asks for gzip at every scrape, so a scan that finds new snapshot files
compresses its body once, on the scrape's path. For 8 DeepSeek-V4 ranks (254 KB) the
standard library's zlib at level 1 took 0.89 ms and ISA-L's at level 1 (the `isal`
package, `isal.igzip`) 0.11 ms, to 16.7 and 16.3 KB (docs/benchmarks-history.md, "Round 7").
Both write one ordinary gzip member (RFC 1952: header, deflate stream, CRC-32 and length;
mtime 0, so a body's bytes depend on its text only) that every gzip reader takes.

`isal` is a dependency of kvledger on the machines it publishes wheels for; elsewhere
(or when it cannot be imported) zlib does the work, and `BACKEND` says which.
"""

from __future__ import annotations

import gzip
from types import ModuleType

_isal: ModuleType | None
try:
    from isal import igzip as _isal
except ImportError:  # no wheel for this machine: the standard library's zlib
    _isal = None

# The fastest level of each that still compresses like zlib's level 1 (ISA-L's 0 writes
# 16 % more bytes for 7 % less time); levels are not comparable between the two.
ISAL_LEVEL = 1
ZLIB_LEVEL = 1
BACKEND = "isal" if _isal is not None else "zlib"


def gzip_body(data: bytes) -> bytes:
    """`data` as one gzip member, mtime 0."""
    if _isal is not None:
        return _isal.compress(data, ISAL_LEVEL, mtime=0)
    return gzip.compress(data, ZLIB_LEVEL, mtime=0)
