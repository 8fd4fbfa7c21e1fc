"""The version the exporter reports (`kvledger_build_info`, the API's schema): the installed
distribution's, read from its metadata, so the exporter names no package above it."""

from importlib import metadata

DISTRIBUTION = "kvledger"

try:
    VERSION = metadata.version(DISTRIBUTION)
except metadata.PackageNotFoundError:  # a source tree that was never installed
    VERSION = "0+unknown"
