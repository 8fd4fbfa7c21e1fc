"""The one table of figures. Everything that names a figure reads it from here.

Bytes figures add up over buffers. Slot figures add up over accounts (one index
space shared by the layer buffers of a pool), since every layer buffer of a
pool holds the same slots.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    name: str
    unit: str  # "bytes" or "slots"
    meaning: str
    relation: str

    @property
    def per_account(self) -> bool:
        """True for slot figures: one value per index space, not per layer buffer."""
        return self.unit == "slots"


FIGURES: tuple[Figure, ...] = (
    Figure(
        "tensor_bytes",
        "bytes",
        "numel * element_size of the tensors handed to the model; for a VMM buffer its "
        "full virtual extent",
        "tensor_bytes <= reserved_bytes",
    ),
    Figure(
        "reserved_bytes",
        "bytes",
        "virtual address space reserved for the buffer, aligned to the granularity; for an "
        "ordinary tensor its storage",
        "mapped_bytes <= reserved_bytes",
    ),
    Figure(
        "physical_bytes",
        "bytes",
        "device memory held for the buffer: every live physical handle, mapped or spare, or "
        "the storage of an ordinary tensor",
        "mapped_bytes <= physical_bytes; a whole number of pages",
    ),
    Figure(
        "mapped_bytes",
        "bytes",
        "the part of physical_bytes mapped into the buffer's address range",
        "occupied_bytes <= mapped_bytes <= physical_bytes; a whole number of pages",
    ),
    Figure(
        "occupied_bytes",
        "bytes",
        "occupied_slots * slot_bytes: bytes holding live requests' entries",
        "occupied_bytes <= mapped_bytes",
    ),
    Figure(
        "occupied_slots",
        "slots",
        "slots (tokens, compressed rows, state rows) allocated to live requests",
        "occupied_slots <= capacity_slots",
    ),
    Figure(
        "capacity_slots",
        "slots",
        "slots the buffer can hold",
        "occupied_slots <= capacity_slots",
    ),
)

_BY_NAME = {f.name: f for f in FIGURES}
FIGURE_NAMES: tuple[str, ...] = tuple(_BY_NAME)


def figure(name: str) -> Figure:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown figure {name!r}; expected one of {', '.join(_BY_NAME)}") from None


def markdown_table() -> str:
    """The figures as a Markdown table (README.md embeds it; `python -m accounting` prints it;
    a test keeps them equal)."""
    rows = ["| figure | unit | meaning | relation |", "|---|---|---|---|"]
    rows += [f"| `{f.name}` | {f.unit} | {f.meaning} | `{f.relation}` |" for f in FIGURES]
    return "\n".join(rows)
