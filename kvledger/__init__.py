"""kvledger's command line and what ties the packages together: the engine integrations
(`engines/`), the embedded demo (`demo/`) and the tools (`tools/`: bench, dashboards,
inspect). The accounting, the allocator and the exporter stand below it and import
nothing from it."""

from importlib import metadata

try:
    __version__ = metadata.version("kvledger")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
