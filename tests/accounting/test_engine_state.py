"""accounting.engine_state: what the engine says of its requests, and what a listed request
may claim against the families' occupied bytes (issue 43 finding 5)."""

from __future__ import annotations

from accounting.engine_state import (
    REQUEST_FAMILY_WITHIN_OCCUPIED,
    REQUEST_WITHIN_OCCUPIED,
    RequestHeld,
    engine_state,
    request_violations,
)


def test_a_request_claims_at_most_what_its_families_hold() -> None:
    occupied = {"swa_kv": 262_144, "c4_kv": 4096}
    ok = RequestHeld("ok", 5, 1.0, 266_240, {"swa_kv": 262_144, "c4_kv": 4096})
    assert request_violations(engine_state(holders_from="T", requests=[ok]), occupied) == []
    assert request_violations(None, occupied) == []
    pib = RequestHeld("pib", 5, 1.0, 1 << 50)  # no split: held against every family's sum
    split = RequestHeld("split", 5, 1.0, 8192, {"c4_kv": 8192})
    elsewhere = RequestHeld("elsewhere", 5, 1.0, 10, {"nope": 10})  # a family holding nothing
    got = request_violations(
        engine_state(holders_from="T", requests=[pib, split, elsewhere]), occupied
    )
    assert [(v.subject, v.relation, v.detail) for v in got] == [
        ("request pib", REQUEST_WITHIN_OCCUPIED, f"bytes={1 << 50}, tensor_bytes=266240"),
        ("request split", REQUEST_FAMILY_WITHIN_OCCUPIED, "c4_kv: bytes=8192, tensor_bytes=4096"),
        ("request elsewhere", REQUEST_FAMILY_WITHIN_OCCUPIED, "nope: bytes=10, tensor_bytes=0"),
    ]
