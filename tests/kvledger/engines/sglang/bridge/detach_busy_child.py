"""Child process of test_bridge_gpu.py's detach-beside-a-hog test, on a GPU with SGLang.

    python -m tests.kvledger.engines.sglang.bridge.detach_busy_child [--no-drain] [--rounds N] [--cpu]

N times: SGLang 0.5.23's DeepSeek-V4 pool on cuda:0, bridged (CudaBackend), three requests
prefilled, every held row (and the padding row) filled with a known pattern; the stream kept
busy (`torch.cuda._sleep`, then a matmul chain), then `Bridge.detach()` at once: its
copy-back into native tensors is queued behind that work when the store unmaps. Prints one
JSON line: rounds run, wrong bytes in the native buffers, the error if the context faulted.
`--no-drain` takes the store's device drain out (the code before issue 23's fix); `--cpu`
runs the same steps on the host backend, nothing queued (a check of the child itself).
"""

from __future__ import annotations

import json
import sys

from tests.allocator.cuda_busy_probe import busy_stream, fault_text, rounds_arg, undrained

EXACT = {"max_spare_pages": 0, "handle_pool_pages": 0, "unmap_grace_s": 0.0, "map_ahead": False}


def rounds(n: int, drain: bool, dev: str) -> dict[str, object]:
    import torch

    from accounting.ledger import Ledger
    from kvledger.engines.sglang.bridge import ENV_ENABLE, attach
    from kvledger.tools.bench.sglang_engine import Engine, Shape, published

    if not drain:
        undrained()
    shape = Shape(layers=4, swa_pages=96, full_pages=192, requests=8, max_context=4096)
    done = wrong = 0
    error = ""
    with published():
        side = 4096 if dev.startswith("cuda") else 8  # the matmuls that keep the stream busy
        x = torch.randn(side, side, device=dev).to(torch.bfloat16)
        try:
            for k in range(n):
                e = Engine(shape, dev)
                br = attach(
                    e.pool, Ledger(), allocator=e.allocator, env={ENV_ENABLE: "1"},
                    require=True, pool_options=EXACT,
                )  # fmt: skip
                assert br.active and br.follower is not None, br.reason
                for _ in range(3):
                    e.prefill(2000)
                br.flush()
                rows = torch.tensor([0, *br.follower.held().tolist()], device=dev)
                bufs = e.pool.swa_kv_pool.kv_buffer
                want = []
                for layer, t in enumerate(bufs):
                    cols = torch.arange(t.shape[1], device=dev)
                    pat = ((rows[:, None] * 7 + cols[None, :] + 13 * layer + k) % 251).to(
                        torch.uint8
                    )
                    t[rows] = pat
                    want.append(pat)
                cuda = dev.startswith("cuda")
                if cuda:
                    busy_stream(x)  # detach's copies wait behind it
                br.detach()  # copies queued, then the store closes
                if cuda:
                    torch.cuda.synchronize()
                got = [t[rows] for t in e.pool.swa_kv_pool.kv_buffer]
                wrong += sum(int((g != w).sum()) for g, w in zip(got, want, strict=True))
                done += 1
        except Exception as ex:  # a faulted context
            error = fault_text(ex)
    return {"rounds": done, "wanted": n, "wrong_bytes": wrong, "error": error, "drain": drain}


def main(argv: list[str]) -> int:
    n = rounds_arg(argv, 5)
    dev = "cpu" if "--cpu" in argv else "cuda:0"
    print(json.dumps(rounds(n, drain="--no-drain" not in argv, dev=dev)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
