"""The snapshot's `request_slots` part (`accounting.request_slots`), checked as hostile input.

`request_slots_of` checks its shape and its own agreement, the way
`accounting.snapfile.schema.engine_state_of` checks SGLang's footprints in bytes: bounded
lists, short printable request ids, integers in range, each family's histogram counting
every running request, the listed requests in the buckets their slots fall in, a family's
sum equal to the listed requests' when every running request is listed and within what
the buckets allow otherwise. `request_slots_known` holds it against the accounts: every
family it names is an account's family, and no request claims more slots of a family than
the family has (its accounts' capacity). A fault is a `Refused` ("schema") naming the
field, the value and what was expected.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

from accounting.engine_state import MAX_REQUESTS, MAX_RID
from accounting.request_slots import (
    BUCKETS,
    REQUEST_SLOTS_BUCKETS,
    FamilyRequests,
    RequestSlots,
    RequestSlotsHeld,
)
from accounting.snapfile.format import fail
from accounting.snapfile.schema import (
    MAX_FAMILIES,
    MAX_INT,
    MAX_NAME,
    as_dict,
    as_list,
    get_field,
    int_of,
    plain_ints,
    plain_strs,
)

WHERE = "request_slots"


def request_slots_of(d: Any) -> RequestSlots | None:
    """The part checked, or None when the snapshot has none."""
    if d is None:
        return None
    d = as_dict(d, WHERE)
    running = int_of(d, "running_requests", WHERE)
    families = [
        _family(f, i, running)
        for i, f in enumerate(as_list(get_field(d, "families", WHERE), f"{WHERE}.families",
                                      MAX_FAMILIES))
    ]  # fmt: skip
    names = [f.family for f in families]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise fail(WHERE, f"families: {dup!r:.60} listed twice, expected each family once")
    listed = as_list(d.get("requests") or [], f"{WHERE}.requests", MAX_REQUESTS)
    if len(listed) > running:
        raise fail(WHERE, f"{len(listed)} requests listed, running_requests={running}")
    requests = [_request(r, i, set(names)) for i, r in enumerate(listed)]
    for f in families:
        _family_agrees(f, requests, running)
    return RequestSlots(running, tuple(families), tuple(requests))


def _family(f: Any, i: int, running: int) -> FamilyRequests:
    at = f"{WHERE}.families[{i}]"
    f = as_dict(f, at)
    name = get_field(f, "family", at)
    if not plain_strs([name]):
        raise fail(at, f"family={name!r:.60}, expected a string of at most {MAX_NAME} characters")
    counts = as_list(get_field(f, "counts", at), f"{at}.counts", BUCKETS)
    if len(counts) != BUCKETS or not plain_ints(counts):
        raise fail(at, f"counts={counts!r:.60}, expected {BUCKETS} non-negative integers")
    if sum(counts) != running:
        raise fail(at, f"counts sum to {sum(counts)}, running_requests={running}")
    return FamilyRequests(name, int_of(f, "slots_sum", at), tuple(counts))


def _request(r: Any, i: int, families: set[str]) -> RequestSlotsHeld:
    at = f"{WHERE}.requests[{i}]"
    r = as_dict(r, at)
    rid = get_field(r, "rid", at)
    if not isinstance(rid, str) or len(rid) > MAX_RID or not rid.isprintable():
        raise fail(
            at, f"rid={rid!r:.60}, expected a printable string of at most {MAX_RID} characters"
        )
    by = as_dict(r.get("slots_by_family") or {}, f"{at}.slots_by_family")
    unknown = sorted(str(k) for k in set(by) - families)
    if unknown:
        raise fail(at, f"slots_by_family names {unknown[0]!r:.60}, not one of the families listed")
    if not plain_ints(list(by.values())):
        bad = next(v for v in by.values() if type(v) is not int or not 0 <= v <= MAX_INT)
        raise fail(at, f"slots_by_family: {bad!r:.60}, expected non-negative integers")
    return RequestSlotsHeld(rid, int_of(r, "tokens", at), dict(by))


def _family_agrees(f: FamilyRequests, requests: Sequence[RequestSlotsHeld], running: int) -> None:
    """One set of rows told three ways (the listed requests, the histogram, the sum)."""
    at = f"{WHERE}.families[{f.family!r:.60}]"
    slots = [r.slots_by_family.get(f.family, 0) for r in requests]
    listed = sum(slots)
    if len(requests) == running and f.slots_sum != listed:
        raise fail(
            at,
            f"slots_sum={f.slots_sum}, but the {running} running requests, every one listed, "
            f"sum to {listed}",
        )
    if f.slots_sum < listed:
        raise fail(at, f"slots_sum={f.slots_sum}, less than the listed requests' {listed}")
    bounds = REQUEST_SLOTS_BUCKETS
    in_bucket = [0] * BUCKETS
    for s in slots:
        in_bucket[bisect.bisect_left(bounds, s)] += 1
    for i, (n, have) in enumerate(zip(in_bucket, f.counts, strict=True)):
        if n > have:
            le = f"<= {bounds[i]}" if i < len(bounds) else f"> {bounds[-1]}"
            raise fail(at, f"{n} listed requests hold {le} slots, counts[{i}]={have}")
    lo = sum(n * (bounds[i - 1] + 1) for i, n in enumerate(f.counts) if i and n)
    hi = sum(n * bounds[i] for i, n in enumerate(f.counts[:-1]))
    if f.slots_sum < lo or (not f.counts[-1] and f.slots_sum > hi):
        raise fail(
            at,
            f"slots_sum={f.slots_sum}, outside what counts allow "
            f"([{lo}, {hi if not f.counts[-1] else 'unbounded'}])",
        )


def request_slots_known(part: RequestSlots | None, accounts: Mapping[str, list[Any]]) -> None:
    """`part` against the snapshot's account columns: its families are accounts' families,
    and no request holds more slots of a family than the family's capacity, nor a family's
    requests together more than each of them could (running x capacity)."""
    if part is None:
        return
    capacity: dict[str, int] = {}
    for family, cap in zip(accounts["family"], accounts["capacity_slots"], strict=True):
        capacity[family] = capacity.get(family, 0) + cap
    for f in part.families:
        if f.family not in capacity:
            at = f"{WHERE}.families[{f.family!r:.60}]"
            raise fail(at, "not a family of this snapshot's accounts")
    for i, r in enumerate(part.requests):
        for family, slots in r.slots_by_family.items():
            if slots > capacity[family]:
                raise fail(
                    f"{WHERE}.requests[{i}]",
                    f"{family}: slots={slots}, more than the family's {capacity[family]} slots",
                )
    for f in part.families:
        at = f"{WHERE}.families[{f.family!r:.60}]"
        if f.slots_sum > part.running_requests * capacity[f.family]:
            raise fail(
                at,
                f"slots_sum={f.slots_sum}, more than running_requests={part.running_requests} "
                f"x the family's {capacity[f.family]} slots",
            )
