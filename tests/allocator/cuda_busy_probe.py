"""A GPU kept busy by another process, and children that close a store beside it.

Shared by tests/allocator/test_cuda_busy_unmap.py (child: `close` below) and
tests/kvledger/engines/sglang/bridge/test_bridge_gpu.py (child: detach_busy_child): `beside_a_hog`
starts the hog, runs a child module, and returns the child's last line, one JSON object;
`busy_stream`, `undrained` and `fault_text` are the children's common steps.

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
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PROBE = "tests.allocator.cuda_busy_probe"


def beside_a_hog(child: list[str], *, hog_seconds: float, timeout: float) -> dict[str, Any]:
    """Run `python -m CHILD...` from the repository root while a hog child keeps cuda:0 busy;
    the child's last stdout line, parsed as JSON. Fails if the hog stops first or the child
    exits non-zero (with the end of its stderr)."""
    hog = subprocess.Popen(
        [sys.executable, "-m", PROBE, "hog", str(hog_seconds)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        ready = hog.stdout.readline().strip() if hog.stdout is not None else ""
        assert ready == "hog ready", f"the hog said {ready!r}, expected 'hog ready'"
        run = subprocess.run(
            [sys.executable, "-m", *child],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert hog.poll() is None, "the hog stopped before the child ended"
    finally:
        hog.kill()
        hog.wait()
    print(run.stdout, run.stderr[-2000:])
    assert run.returncode == 0, run.stderr[-2000:]
    return dict(json.loads(run.stdout.strip().splitlines()[-1]))


def undrained() -> None:
    """Take the page store's device drain out (the code before issue 23's fix)."""
    from allocator.store import PageStore

    PageStore._drain_device = lambda self: None  # type: ignore[method-assign]


def busy_stream(x: Any) -> None:
    """Keep the current stream busy: a sleep kernel, then a chain of matmuls of `x`; what is
    queued after waits behind them."""
    import torch

    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)
    y = x
    for _ in range(8):
        y = y @ x


def fault_text(e: BaseException) -> str:
    """One line for a faulted context (cudaErrorIllegalAddress and the like)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def rounds_arg(argv: list[str], default: int) -> int:
    return int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else default


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
        undrained()
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
            busy_stream(x)  # the copies below wait behind it
            for v, n in zip(views, native, strict=True):
                n.copy_(v)  # queued: the copy-back of a detach
            del views
            store.close()  # unmaps now; the copies have not run unless close waited
            torch.cuda.synchronize()
            wrong += sum(int((n != p).sum()) for n, p in zip(native, pattern, strict=True))
            done += 1
    except Exception as e:  # a faulted context
        error = fault_text(e)
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
        out = close_rounds(rounds_arg(argv, 20), drain="--no-drain" not in argv)
        print(json.dumps(out), flush=True)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
