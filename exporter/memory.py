"""Giving freed memory back to the operating system (glibc's `malloc_trim`, through ctypes;
the only user of libc here).

After many snapshot files are gone (thousands planted, then removed) the exporter's Python
objects for them are freed, but glibc keeps the freed heap for reuse and the process's RSS
stays where it peaked. `release_free_memory()` asks glibc to return it; elsewhere (musl,
macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def release_free_memory() -> bool:
    """Return the heap's free memory to the OS where glibc allows; True if it could try."""
    fn = _trim()
    if fn is None:
        return False
    fn(0)
    return True
