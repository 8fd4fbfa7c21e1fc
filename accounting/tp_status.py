"""One TP rank's view of its control traffic with the other ranks, carried in each snapshot.

Filled by `allocator.tp.TpCoordinator`; the ledger only carries it. A divergence
(a rank whose allocation sequence no longer matches rank 0's) or a peer failure
(a rank that died or stopped answering) counts here before the coordinator
raises, so the last snapshot shows it. Exporters read `divergences_total`
and `peer_failures_total` (counters, per `tp_rank`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# The counters of a TpStatus, named once: the exporter's series are `kvledger_tp_<counter>`.
TP_COUNTERS: tuple[str, ...] = (
    "exchanges_total",
    "page_ops_total",
    "divergences_total",
    "peer_failures_total",
)


@dataclass(frozen=True)
class TpStatus:
    rank: int
    size: int
    exchanges_total: int  # collectives this rank took part in (page changes, checks)
    page_ops_total: int  # page ids mapped or unmapped as decided at those exchanges
    divergences_total: int  # exchanges at which some rank's view differed from rank 0's
    peer_failures_total: int  # exchanges that failed: a rank died or did not answer in time
    last_error: str = ""  # the message of the last divergence or peer failure, "" if none

    def __post_init__(self) -> None:
        for name in ("rank", "size", *TP_COUNTERS):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"TpStatus: {name}={value!r}, expected a non-negative int")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TpStatus: rank={self.rank}, expected 0 <= rank < size={self.size}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TpStatus:
        return cls(**d)
