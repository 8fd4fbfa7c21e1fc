"""Where a GPU's memory went: the parts of one device's used memory, defined once.

docs/background.md#where-the-gpu-went explains each part; this module is the
definition the code reads. `PARTS` is the table (name, scope, meaning, the read it
rests on); `parts_of(readings)` computes every part from one set of `Readings`;
`check_parts` holds the result against the two NVML figures the parts must add up
to. The arithmetic imports neither torch nor pynvml: the readings come from
`accounting.torch_memory` (torch's caching allocator, the model's parameters) and
`accounting.nvml` (the device), or from a stand-in in a test.

Two bases, named in every result (`basis`):

- `process`: NVML lists this process. `outside_torch` is NVML's per-process figure
  less torch's segments and the VMM mappings, read live, so the process's parts add up
  to that figure; `other_processes` is the rest of NVML's device-wide used memory (the
  other processes and the driver memory NVML charges to no process).
- `device`: NVML does not list this process (a container's pid namespace, MIG, no
  permission). Then what the device held at the baseline, beyond torch's segments and
  the VMM pools, is `other_processes` (this process's CUDA context and whatever other
  processes held then), `outside_torch` is the growth outside torch frozen at the named
  points (`rebaseline`), and growth since the last one is `unattributed`.

In both bases `unattributed` is what is left of NVML's device-wide used memory once
every other part is counted; with basis `process` that is 0 unless the reads disagree
(a part read at another moment than NVML's figures). The reconciliation's own
`unattributed_bytes` (`kvledger_unattributed_bytes`) is another figure: growth outside
torch and the VMM pools since the last named point, the leak detector.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from accounting.relations import Violation


@dataclass(frozen=True)
class Part:
    name: str
    scope: str  # "process" (this process's memory) or "device" (the rest of the device)
    meaning: str
    rests_on: str  # the read it is computed from


PARTS: tuple[Part, ...] = (
    Part(
        "weights",
        "process",
        "the model's parameters and buffers on this device, each storage counted once (tied "
        "or shared tensors, a draft model sharing the target's embedding)",
        "torch: untyped_storage() of every parameter and buffer of the runner's modules, "
        "keyed by data pointer",
    ),
    Part(
        "kv",
        "process",
        "physical bytes of every KV buffer family in the ledger: VMM handles alive, "
        "runtime-owned tensors' storage, the backed span of SGLang's own VMM-backed buffers",
        "the ledger's physical_bytes (accounting.figures)",
    ),
    Part(
        "cuda_graphs",
        "process",
        "segments of the private memory pools of captured CUDA graphs (allocated or not: "
        "a graph keeps its pool)",
        "torch.cuda.memory_snapshot(): segments of a capture's own pool (non-zero first id) "
        "or of a graph pool handle the engine shares (SGLang's global graph pool)",
    ),
    Part(
        "activations",
        "process",
        "every other live torch allocation in the ordinary pools: activations, workspaces, "
        "sampling and scheduler buffers",
        "torch allocated bytes minus weights, runtime-owned KV and the graph and VMM-arena "
        "pools' allocations",
    ),
    Part(
        "allocator_slack",
        "process",
        "torch's caching allocator: reserved minus allocated in the ordinary pools (cached "
        "free blocks, not returned to the driver)",
        "torch.cuda.memory_reserved() - memory_allocated(), graph and VMM-arena pools apart",
    ),
    Part(
        "outside_torch",
        "process",
        "this process's memory that torch does not allocate: the CUDA context, loaded "
        "modules and executable graphs, communication buffers, cuMemAlloc by libraries; "
        "kvledger's and SGLang's VMM mappings are not in it (they are kv)",
        "NVML per-process used minus torch's segments (VMM arenas apart) and the VMM "
        "mappings, live (basis device: the growth outside torch frozen at each named point)",
    ),
    Part(
        "other_processes",
        "device",
        "the rest of the device's used memory: other processes, and driver memory NVML "
        "charges to no process",
        "NVML device used minus this process's NVML figure (basis process); the device's "
        "used memory at the baseline beyond this process's torch and VMM bytes (basis device)",
    ),
    Part(
        "unattributed",
        "device",
        "what is left of the device's used memory once every other part is counted: 0 with "
        "basis process (but for reads taken at different moments); basis device: growth "
        "outside torch since the last named point, here or in another process",
        "NVML device used minus every other part",
    ),
)

PART_NAMES: tuple[str, ...] = tuple(p.name for p in PARTS)
PROCESS_PARTS: tuple[str, ...] = tuple(p.name for p in PARTS if p.scope == "process")
BASES = ("process", "device")
_BY_NAME = {p.name: p for p in PARTS}


def part(name: str) -> Part:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(
            f"unknown GPU part {name!r}; expected one of {', '.join(PART_NAMES)}"
        ) from None


@dataclass(frozen=True)
class TorchMemory:
    """torch's caching allocator on one device, split by pool kind (bytes).

    `reserved_bytes` / `allocated_bytes` cover every pool; the graph and VMM-arena
    figures are the parts of them in captured graphs' pools and in pools whose segments
    are VMM reservations (SGLang's `KvVmmArena`: torch counts their virtual extent)."""

    reserved_bytes: int = 0
    allocated_bytes: int = 0
    graph_reserved_bytes: int = 0
    graph_allocated_bytes: int = 0
    arena_reserved_bytes: int = 0
    arena_allocated_bytes: int = 0

    @property
    def physical_bytes(self) -> int:
        """Device memory torch's own segments hold: everything but the VMM arenas' virtual
        extent (their backed span is in the ledger's VMM bytes)."""
        return self.reserved_bytes - self.arena_reserved_bytes

    @property
    def ordinary_allocated_bytes(self) -> int:
        return self.allocated_bytes - self.graph_allocated_bytes - self.arena_allocated_bytes

    @property
    def ordinary_reserved_bytes(self) -> int:
        return self.reserved_bytes - self.graph_reserved_bytes - self.arena_reserved_bytes


@dataclass(frozen=True)
class Baseline:
    """What is named before the parts are read: figures at the baseline and the growth
    outside torch frozen since (`accounting.nvml.NvmlTruth.rebaseline`)."""

    device_used: int  # NVML device-wide used at the baseline
    process_used: int | None  # NVML per-process at the baseline (None: basis device)
    torch_physical: int  # TorchMemory.physical_bytes at the baseline
    vmm_bytes: int  # the ledger's VMM-owned physical bytes at the baseline
    named_outside_bytes: int = 0  # growth outside torch frozen at the named points


@dataclass(frozen=True)
class Readings:
    """One moment's reads, everything `parts_of` needs."""

    device_used: int  # NVML device-wide used (v2)
    process_used: int | None  # NVML's figure for this pid; None where it cannot be read
    torch: TorchMemory
    weights_bytes: int
    kv_bytes: int  # the ledger's physical bytes, every family
    kv_torch_bytes: int  # the part of kv_bytes that is runtime-owned tensors in ordinary pools
    vmm_bytes: int  # the part of kv_bytes held by VMM mappings (kvledger's, SGLang's arenas)
    baseline: Baseline


def basis_of(readings: Readings) -> str:
    both = readings.process_used is not None and readings.baseline.process_used is not None
    return "process" if both else "device"


def parts_of(r: Readings) -> dict[str, int]:
    """Every part (`PART_NAMES`, in order) from one set of readings. Never clamped: a part
    that comes out negative is a reading or a counting bug, and `check_parts` says so."""
    t, b = r.torch, r.baseline
    out = {
        "weights": r.weights_bytes,
        "kv": r.kv_bytes,
        "cuda_graphs": t.graph_reserved_bytes,
        "activations": t.ordinary_allocated_bytes - r.weights_bytes - r.kv_torch_bytes,
        "allocator_slack": t.ordinary_reserved_bytes - t.ordinary_allocated_bytes,
    }
    if basis_of(r) == "process" and r.process_used is not None:
        out["outside_torch"] = r.process_used - t.physical_bytes - r.vmm_bytes
        out["other_processes"] = r.device_used - r.process_used
    else:
        out["outside_torch"] = b.named_outside_bytes
        out["other_processes"] = b.device_used - b.torch_physical - b.vmm_bytes
    out["unattributed"] = r.device_used - sum(out.values())
    return {name: out[name] for name in PART_NAMES}


def process_total(parts: Mapping[str, int]) -> int:
    """The process's parts summed (what NVML's per-process figure must equal, with the
    process's share of `unattributed`)."""
    return sum(parts[name] for name in PROCESS_PARTS)


PART_WITHIN_TOTAL = "every GPU part within the device's total"
SUM_WITHIN_TOTAL = "sum of GPU parts <= device total"
PARTS_HELD = "GPU parts held against NVML device used or the device total"


def check_parts(
    parts: Mapping[str, int],
    *,
    device_used: int | None,
    process_used: int | None,
    basis: str,
    subject: str = "gpu",
    total_bytes: int | None = None,
) -> list[Violation]:
    """The relations of the parts: each one named, none negative but `unattributed`, all
    of them adding up to NVML's device-wide used memory, and (basis process) the
    process's parts plus `unattributed` to NVML's per-process figure. With the device's
    size (`total_bytes`), every part (`unattributed` either way) and their sum at most
    that: a part of 500 GiB on an 80 GiB card is a violation even where NVML's used figure
    is missing (which would skip the sum). Parts with neither figure to be held against
    are a violation too: nothing bounds them."""
    out: list[Violation] = []
    missing = [n for n in PART_NAMES if n not in parts]
    extra = sorted(set(parts) - set(PART_NAMES))
    if missing or extra:
        return [
            Violation(
                subject,
                "every GPU part named once",
                f"missing {missing or 'none'}, unknown {extra or 'none'}",
            )
        ]
    for name in PART_NAMES:
        if name != "unattributed" and parts[name] < 0:
            out.append(Violation(subject, f"{name} >= 0", f"{name}={parts[name]}"))
    total = sum(parts[n] for n in PART_NAMES)
    if device_used is not None and total != device_used:
        out.append(
            Violation(
                subject,
                "sum of GPU parts == NVML device used",
                f"sum={total}, device_used={device_used}",
            )
        )
    if total_bytes is not None:
        for name in PART_NAMES:
            if abs(parts[name]) > total_bytes:
                out.append(
                    Violation(
                        subject,
                        PART_WITHIN_TOTAL,
                        f"{name}={parts[name]}, total_bytes={total_bytes}",
                    )
                )
        if total > total_bytes:
            out.append(
                Violation(subject, SUM_WITHIN_TOTAL, f"sum={total}, total_bytes={total_bytes}")
            )
    elif device_used is None:
        out.append(Violation(subject, PARTS_HELD, "neither used_bytes nor total_bytes is given"))
    if basis == "process" and process_used is not None:
        mine = process_total(parts) + parts["unattributed"]
        if mine != process_used:
            out.append(
                Violation(
                    subject,
                    "process parts + unattributed == NVML process used",
                    f"sum={mine}, process_used={process_used}",
                )
            )
    return out


def markdown_table() -> str:
    """The parts as a Markdown table (docs/background.md embeds it; a test keeps them equal)."""
    rows = ["| part | scope | meaning | rests on |", "|---|---|---|---|"]
    rows += [f"| `{p.name}` | {p.scope} | {p.meaning} | {p.rests_on} |" for p in PARTS]
    return "\n".join(rows)
