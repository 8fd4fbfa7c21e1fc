"""kvledger's command line and the pieces that tie the packages together (demo source, benchmarks)."""

__version__ = "0.1.0"
