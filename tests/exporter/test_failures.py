"""exporter.failures: a source left out is counted by reason, logged by name, at a bounded rate."""

from __future__ import annotations

import logging

import pytest

from exporter.failures import SourceFailures


def test_counts_every_failure_and_logs_a_source_at_most_once_per_interval(caplog):
    now = [0.0]
    failures = SourceFailures(
        ("render",), logging.getLogger("t"), log_every=60, clock=lambda: now[0]
    )
    for _ in range(3):
        failures.failed("render", "a", ValueError("x"))
    failures.failed("render", "b", ValueError("y"))  # another source: a line of its own
    assert failures.counts == {"render": 4}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "source a left out" in lines[0] and "source b" in lines[1]
    assert caplog.records[0].exc_info is not None  # the traceback goes with it
    now[0] = 61.0
    failures.failed("render", "a", ValueError("x"))
    assert "(2 more since the last line)" in caplog.records[-1].getMessage()
    assert failures.counts == {"render": 5}


def test_the_same_version_of_a_source_is_counted_once():
    failures = SourceFailures(("render",), logging.getLogger("t"))
    version, other = object(), object()
    for _ in range(3):
        failures.failed("render", "a", ValueError("x"), version=version)
    failures.failed("render", "a", ValueError("x"), version=other)
    assert failures.counts == {"render": 2}


def test_a_reason_outside_the_set_is_refused_naming_it():
    failures = SourceFailures(("render",), logging.getLogger("t"))
    with pytest.raises(ValueError, match="reason='snapshot'"):
        failures.failed("snapshot", "a", ValueError("x"))
