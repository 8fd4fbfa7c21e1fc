"""The relations every snapshot must keep, checked per buffer and per account
(docs/background.md#the-four-figures).

A violation is reported, never clamped: the figures stay as counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from accounting.buffers import Owner
from accounting.figures import HOLDER_RELATION
from accounting.rows import AccountRow, BufferRow


@dataclass(frozen=True)
class Violation:
    subject: str  # buffer name or account key
    relation: str  # e.g. "mapped_bytes <= physical_bytes"
    detail: str  # the values that broke it

    def to_dict(self) -> dict[str, Any]:
        return {"subject": self.subject, "relation": self.relation, "detail": self.detail}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Violation:
        return cls(d["subject"], d["relation"], d["detail"])


def _le(subject: str, a_name: str, a: int, b_name: str, b: int) -> list[Violation]:
    if a <= b:
        return []
    return [Violation(subject, f"{a_name} <= {b_name}", f"{a_name}={a} > {b_name}={b}")]


def check_buffer(row: BufferRow) -> list[Violation]:
    s = row.spec
    subject = f"{s.pool}/{s.name}"
    out: list[Violation] = []
    for name, value in row.figures().items():
        if value < 0:
            out.append(Violation(subject, f"{name} >= 0", f"{name}={value}"))
    out += _le(subject, "tensor_bytes", s.tensor_bytes, "reserved_bytes", s.reserved_bytes)
    out += _le(subject, "mapped_bytes", row.mapped_bytes, "reserved_bytes", s.reserved_bytes)
    out += _le(subject, "mapped_bytes", row.mapped_bytes, "physical_bytes", row.physical_bytes)
    out += _le(subject, "occupied_slots", row.occupied_slots, "capacity_slots", s.capacity_slots)
    if s.owner is Owner.VMM:
        out += _le(subject, "occupied_bytes", row.occupied_bytes, "mapped_bytes", row.mapped_bytes)
        for name in ("physical_bytes", "mapped_bytes"):
            value = getattr(row, name)
            if row.page_bytes <= 0 or value % row.page_bytes:
                out.append(
                    Violation(
                        subject,
                        f"{name} is a whole number of pages",
                        f"{name}={value}, page_bytes={row.page_bytes}",
                    )
                )
    else:
        out += _le(subject, "occupied_bytes", row.occupied_bytes, "tensor_bytes", s.tensor_bytes)
    return out


def check_account(row: AccountRow) -> list[Violation]:
    out: list[Violation] = []
    for name in ("handle_pages", "mapped_pages", "occupied_slots"):
        if getattr(row, name) < 0:
            out.append(Violation(row.key, f"{name} >= 0", f"{name}={getattr(row, name)}"))
    out += _le(row.key, "mapped_pages", row.mapped_pages, "handle_pages", row.handle_pages)
    out += _le(row.key, "occupied_slots", row.occupied_slots, "capacity_slots", row.capacity_slots)
    held = row.held
    if held.total() != row.occupied_slots:
        out.append(
            Violation(
                row.key,
                HOLDER_RELATION,
                ", ".join(f"{k}={v}" for k, v in held.to_dict().items())
                + f" sum to {held.total()}, occupied_slots={row.occupied_slots}",
            )
        )
    return out
