"""The one table of figures. Everything that names a figure reads it from here.

Bytes figures add up over buffers. Slot figures add up over accounts (one index
space shared by the layer buffers of a pool), since every layer buffer of a
pool holds the same slots.

The table is declared once, as the fields of `Figures` (one value of every
figure: a family's rollup, a source's totals), each field with its unit, meaning
and relation; `FIGURES` is read from those fields, so code that holds figures
(`figures.physical_bytes`) and code that walks the table (`FIGURES`) cannot drift.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


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


def _about(unit: str, meaning: str, relation: str) -> dict[str, str]:
    return {"unit": unit, "meaning": meaning, "relation": relation}


@dataclass(frozen=True)
class Figures:
    """One value of every figure, each kept separately and never summed into another."""

    tensor_bytes: int = field(
        metadata=_about(
            "bytes",
            "numel * element_size of the tensors handed to the model; for a VMM buffer its "
            "full virtual extent",
            "tensor_bytes <= reserved_bytes",
        )
    )
    reserved_bytes: int = field(
        metadata=_about(
            "bytes",
            "virtual address space reserved for the buffer, aligned to the granularity; for an "
            "ordinary tensor its storage",
            "mapped_bytes <= reserved_bytes",
        )
    )
    physical_bytes: int = field(
        metadata=_about(
            "bytes",
            "device memory held for the buffer: every live physical handle, mapped or spare, "
            "or the storage of an ordinary tensor",
            "mapped_bytes <= physical_bytes; a whole number of pages",
        )
    )
    mapped_bytes: int = field(
        metadata=_about(
            "bytes",
            "the part of physical_bytes mapped into the buffer's address range",
            "occupied_bytes <= mapped_bytes <= physical_bytes; a whole number of pages",
        )
    )
    occupied_bytes: int = field(
        metadata=_about(
            "bytes",
            "occupied_slots * slot_bytes: bytes holding live requests' entries",
            "occupied_bytes <= mapped_bytes",
        )
    )
    occupied_slots: int = field(
        metadata=_about(
            "slots",
            "slots (tokens, compressed rows, state rows) allocated to live requests",
            "occupied_slots <= capacity_slots",
        )
    )
    capacity_slots: int = field(
        metadata=_about("slots", "slots the buffer can hold", "occupied_slots <= capacity_slots")
    )

    @classmethod
    def of(cls, values: Mapping[str, int]) -> Figures:
        """From a mapping of figure name to value (e.g. a `Snapshot.rollup` row)."""
        return cls(*(values[name] for name in FIGURE_NAMES))

    @classmethod
    def sum(cls, rows: Iterable[Figures]) -> Figures:
        """Every figure summed over `rows` (all zero for none)."""
        columns = tuple(zip(*map(_values, rows), strict=True))
        return cls(*map(sum, columns)) if columns else cls(*(0,) * len(FIGURE_NAMES))

    def values(self) -> tuple[int, ...]:
        """The figures in table order (`FIGURE_NAMES`)."""
        return _values(self)

    def to_dict(self) -> dict[str, int]:
        return dict(zip(FIGURE_NAMES, _values(self), strict=True))


FIGURES: tuple[Figure, ...] = tuple(
    Figure(f.name, **f.metadata) for f in dataclasses.fields(Figures)
)

_BY_NAME = {f.name: f for f in FIGURES}
FIGURE_NAMES: tuple[str, ...] = tuple(_BY_NAME)
_values = operator.attrgetter(*FIGURE_NAMES)


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


# -- holders: who holds the occupied slots --------------------------------------------------
@dataclass(frozen=True)
class Holder:
    name: str
    meaning: str


HOLDER_PRECEDENCE = (
    "a slot is counted under the first holder that applies, in this order: tree_protected, "
    "tree_evictable, request_only, unattributed; so the holders are disjoint and add up to "
    "occupied_slots (and, times each buffer's slot_bytes, to occupied_bytes)"
)
HOLDER_RELATION = "tree_protected + tree_evictable + request_only + unattributed == occupied_slots"


@dataclass(frozen=True)
class Held:
    """A split of occupied slots (or bytes) by holder, in the precedence order of
    `HOLDER_PRECEDENCE`: each slot counted once, under the first holder that applies."""

    tree_protected: int = field(
        default=0,
        metadata={
            "meaning": "in the engine's prefix tree and locked by a running request (part "
            "of its matched or inserted prefix): not reclaimable while that request runs"
        },
    )
    tree_evictable: int = field(
        default=0,
        metadata={
            "meaning": "in the prefix tree and locked by no request: cached for reuse, "
            "reclaimable by evicting the prefix"
        },
    )
    request_only: int = field(
        default=0,
        metadata={
            "meaning": "held by a request and not in the prefix tree (its uncached tail, a "
            "request's state rows, or every slot when the engine keeps no tree): freed when "
            "the request finishes or is retracted"
        },
    )
    unattributed: int = field(
        default=0,
        metadata={
            "meaning": "occupied, but whose holder kvledger could not read (no tree reader "
            "for this engine or cache class; /debug/kv names why)"
        },
    )

    def values(self) -> tuple[int, ...]:
        return _held_values(self)

    def total(self) -> int:
        return sum(_held_values(self))

    def to_dict(self) -> dict[str, int]:
        return dict(zip(HOLDER_NAMES, _held_values(self), strict=True))

    def times(self, factor: int) -> Held:
        """Every holder multiplied by `factor` (slots to bytes)."""
        return Held(*(v * factor for v in _held_values(self)))

    @classmethod
    def sum(cls, rows: Iterable[Held]) -> Held:
        columns = tuple(zip(*map(_held_values, rows), strict=True))
        return cls(*map(sum, columns)) if columns else cls()

    @classmethod
    def unattributed_of(cls, occupied: int) -> Held:
        """All of `occupied` with no holder read."""
        return cls(unattributed=occupied)


HOLDERS: tuple[Holder, ...] = tuple(
    Holder(f.name, f.metadata["meaning"]) for f in dataclasses.fields(Held)
)
HOLDER_NAMES: tuple[str, ...] = tuple(h.name for h in HOLDERS)
_held_values = operator.attrgetter(*HOLDER_NAMES)


def holders_markdown_table() -> str:
    """The holders as a Markdown table (README.md embeds it after the figures)."""
    rows = ["| holder | meaning |", "|---|---|"]
    rows += [f"| `{h.name}` | {h.meaning} |" for h in HOLDERS]
    rows.append("")
    rows.append(f"Precedence: {HOLDER_PRECEDENCE}. Relation: `{HOLDER_RELATION}`.")
    return "\n".join(rows)
