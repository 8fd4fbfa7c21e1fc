"""exporter.server.lograte: warnings and errors of one kind at most once per interval."""

from __future__ import annotations

import io
import logging

import pytest

from exporter.server.lograte import RateLimit, install


def _logger(limit: RateLimit) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(limit)
    log = logging.getLogger(f"test-lograte-{id(limit)}")
    log.propagate = False
    log.handlers = [handler]
    log.setLevel(logging.INFO)
    return log, out


def test_one_line_per_kind_per_interval_and_the_next_says_how_many_were_held():
    now = [0.0]
    limit = RateLimit(60, clock=lambda: now[0])
    log, out = _logger(limit)
    for i in range(1000):
        log.error("scan of %s failed: %s", "/d", f"EMFILE {i}")
        log.warning("another kind %d", i)
    log.info("status %d", 1)
    log.info("status %d", 2)  # below WARNING: never held
    lines = out.getvalue().splitlines()
    assert lines == ["scan of /d failed: EMFILE 0", "another kind 0", "status 1", "status 2"]
    assert limit.held == 1998
    now[0] = 61.0
    log.error("scan of %s failed: %s", "/d", "EMFILE again")
    assert out.getvalue().splitlines()[-1] == (
        "scan of /d failed: EMFILE again [999 more like this held back in 60 s]"
    )


def test_bad_interval_is_refused():
    with pytest.raises(ValueError, match="every=0"):
        RateLimit(0)


def test_install_is_idempotent():
    limit = RateLimit()
    log, _ = _logger(RateLimit())
    install(limit, [log.name])
    install(limit, [log.name])
    assert log.handlers[0].filters.count(limit) == 1
