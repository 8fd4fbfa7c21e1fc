"""Child process of tests/allocator/test_cuda_busy_unmap.py (and a hog for it), on a GPU.

python -m tests.allocator.cuda_busy_probe hog SECONDS
    bf16 matmuls back to back on cuda:0 for SECONDS (prints "hog ready" first): another
    process keeping the GPU busy, as a neighbour on a shared H200 would.
python -m tests.allocator.cuda_busy_probe close [--no-drain] [--rounds N]
    N times: a page store on CudaBackend with rows of a known pattern, the stream kept
    busy (`torch.cuda._sleep`, then a matmul chain), the rows copied into a native tensor
    (queued behind that work, as `Bridge.detach()` queues its copy-back), then
    `store.close()` at once. Prints one JSON line: rounds run, wrong bytes, the error if
    the context faulted. `--no-drain` takes the store's device drain out (the code
    before issue 23's fix), to show what the check catches.
"""

from __future__ import annotations

import json
import sys
import time


def hog(seconds: float) -> None:
    import torch

    a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    print("hog ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(16):
            a = (a @ b).clamp_(-1, 1)
        torch.cuda.synchronize()


def close_rounds(rounds: int, drain: bool) -> dict[str, object]:
    import torch

    from allocator.cuda import CudaBackend
    from allocator.store import PageStore

    if not drain:
        PageStore._drain_device = lambda self: None  # type: ignore[method-assign]
    torch.cuda.init()
    layers, pages = 4, 16
    x = torch.randn(4096, 4096, device="cuda:0", dtype=torch.bfloat16)
    wrong = done = 0
    error = ""
    backend = CudaBackend(0)
    gran = backend.granularity
    try:
        for k in range(rounds):
            store = PageStore(
                backend, layers=layers, page_bytes=gran, num_pages=pages, max_spare_pages=pages
            )
            views = [store.byte_tensor(i, pages * gran) for i in range(layers)]
            with store.lock:
                store.map_locked(list(range(pages)))
                for p in range(pages):
                    store.set_use(p, True)
            pattern = [
                torch.full((pages * gran,), (17 * k + i) % 251, dtype=torch.uint8, device="cuda:0")
                for i in range(layers)
            ]
            for v, pat in zip(views, pattern, strict=True):
                v.copy_(pat)
            native = [torch.empty_like(pat) for pat in pattern]
            torch.cuda.synchronize()
            torch.cuda._sleep(50_000_000)  # the stream busy: the copies below wait behind it
            y = x
            for _ in range(8):
                y = y @ x
            for v, n in zip(views, native, strict=True):
                n.copy_(v)  # queued: the copy-back of a detach
            del views
            store.close()  # unmaps now; the copies have not run unless close waited
            torch.cuda.synchronize()
            wrong += sum(int((n != p).sum()) for n, p in zip(native, pattern, strict=True))
            done += 1
    except Exception as e:  # a faulted context: cudaErrorIllegalAddress and the like
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        try:
            backend.close()
        except Exception as e:  # a faulted context refuses this too
            error = error or f"close: {type(e).__name__}: {e}"
    return {"rounds": done, "wanted": rounds, "wrong_bytes": wrong, "error": error, "drain": drain}


def main(argv: list[str]) -> int:
    if argv[:1] == ["hog"]:
        hog(float(argv[1]))
        return 0
    if argv[:1] == ["close"]:
        rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 20
        out = close_rounds(rounds, drain="--no-drain" not in argv)
        print(json.dumps(out), flush=True)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
