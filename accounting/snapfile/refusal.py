"""Why a snapshot file, or its buffer map, is not served: one reason from a fixed set.

A metric is labelled by the reason (`kvledger_snapshot_file_errors_total`), so the set
stays small whatever a directory holds; the detail is one line naming the field, the
value (cut to 60 characters) and what was expected.
"""

from __future__ import annotations

REASONS = (
    "symlink",  # a symbolic link
    "not_regular",  # a FIFO, device, socket or directory
    "owner",  # owned by a user the directory rules do not trust
    "too_large",  # over the size cap
    "open",  # the operating system refused to open or read it
    "parse",  # not UTF-8 JSON in the envelope-then-rows layout
    "nesting",  # nested deeper than the parser allows
    "schema",  # parsed, but a field is missing, of the wrong type or out of range
    "too_many_files",  # over the cap on files per directory
    "buffers",  # the buffer rows, checked when the buffer map is asked for, failed (the
    # source's metrics, from the first line, are still served)
)


class Refused(ValueError):
    def __init__(self, reason: str, detail: str) -> None:
        if reason not in REASONS:
            raise ValueError(f"Refused: reason={reason!r}, expected one of {REASONS}")
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


def fail(where: str, what: str) -> Refused:
    """A "schema" refusal: `where` (e.g. `accounts[3]`) and what is wrong there."""
    return Refused("schema", f"{where}: {what}")
