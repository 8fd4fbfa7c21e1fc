"""`accounting.publisher.Publisher`, the name engines are told to use (README), kept importable.

The publisher lives in `accounting.snapfile.writer`, beside the rest of the snapshot
file (`accounting.snapfile`).
"""

from accounting.snapfile.writer import Publisher

__all__ = ["Publisher"]
