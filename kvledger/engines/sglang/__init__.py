"""kvledger's SGLang wing: everything that knows SGLang 0.5.23's classes or DeepSeek-V4's pools.

- `inventory`: the buffer map of a live SGLang pool (which tensor is which family).
- `dsv4/`: DeepSeek-V4's geometry, the buffer map SGLang would build for a config and a
  budget, and SGLang's planner reproduced (`kvledger inspect`).
- `bridge/`: the DeepSeek-V4 SWA buffers on kvledger's VMM pool, following SGLang's SWA
  page allocator (`allocator_hooks` records what it did, `front_policy` replays it).
- `plugin/`: the `sglang.srt.plugins` entry point and the hooks it registers on SGLang's
  model runner and scheduler (`server_hooks`).

Importing this package imports nothing (SGLang loads the plugin in every process).
`accounting/` stays engine-agnostic: nothing there imports from here.
"""
