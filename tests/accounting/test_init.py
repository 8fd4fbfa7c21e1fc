"""The accounting package's names, imported on first use."""

from __future__ import annotations

import pytest

import accounting


def test_every_name_resolves_to_its_module() -> None:
    from accounting.events import PoolEvent
    from accounting.ledger import Ledger

    assert accounting.Ledger is Ledger and accounting.PoolEvent is PoolEvent
    for name in accounting.__all__:
        assert getattr(accounting, name) is not None


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'Ledgr'"):
        accounting.Ledgr  # type: ignore[attr-defined]  # noqa: B018
