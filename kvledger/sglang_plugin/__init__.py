"""Old import path of `kvledger.sglang.plugin`, kept for one release.

An environment installed before the move still names `kvledger.sglang_plugin:register` as
its `sglang.srt.plugins` entry point until kvledger is reinstalled; this keeps it working.
Importing it imports only `kvledger.sglang.plugin` (nothing more while kvledger is off).
"""

from kvledger.sglang.plugin import register

__all__ = ["register"]
