"""accounting.switches: the one yes/no environment-switch parser."""

from __future__ import annotations

import pytest

from accounting.switches import switch
from tests.imports import imported_after


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("", False),
        ("0", False),
        ("off", False),
        ("No", False),
        (" false ", False),
        ("1", True),
        (" Yes ", True),
        ("TRUE", True),
        ("on", True),
    ],
)
def test_switch_values(raw: str, want: bool) -> None:
    assert switch("X", {"X": raw}) is want


def test_unset_is_off() -> None:
    assert switch("X", {}) is False


@pytest.mark.parametrize("raw", ["maybe", "2", "y", "enabled"])
def test_anything_else_names_the_variable_and_value(raw: str) -> None:
    with pytest.raises(ValueError, match=rf"^KVLEDGER_X={raw!r}, expected one of 1/0/true"):
        switch("KVLEDGER_X", {"KVLEDGER_X": raw})


def test_os_environ_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLEDGER_TEST_SWITCH", "on")
    assert switch("KVLEDGER_TEST_SWITCH") is True
    monkeypatch.delenv("KVLEDGER_TEST_SWITCH")
    assert switch("KVLEDGER_TEST_SWITCH") is False


def test_importing_it_imports_no_other_module_of_the_package() -> None:
    got = imported_after("import accounting.switches", ("accounting",))
    assert got == ["accounting", "accounting.switches"]
