"""The bridge's opt-in switches (no sglang)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvledger.sglang.bridge.activation import ENV_ENABLE, ENV_REQUIRE, BridgeActivation


def test_off_unless_the_variable_says_on() -> None:
    assert BridgeActivation.from_env({}) == BridgeActivation(enabled=False, require=False)
    for on in ("1", "true", "YES", " on "):
        assert BridgeActivation.from_env({ENV_ENABLE: on}).enabled
    for off in ("", "0", "false", "no", "off"):
        assert not BridgeActivation.from_env({ENV_ENABLE: off}).enabled


def test_require_from_env_or_argument() -> None:
    assert BridgeActivation.from_env({ENV_REQUIRE: "1"}).require
    assert not BridgeActivation.from_env({ENV_REQUIRE: "1"}, require=False).require
    assert BridgeActivation.from_env({}, require=True).require


def test_bad_values_name_the_variable() -> None:
    with pytest.raises(ValueError, match=f"{ENV_ENABLE}='maybe'"):
        BridgeActivation.from_env({ENV_ENABLE: "maybe"})
    with pytest.raises(ValueError, match=ENV_REQUIRE):
        BridgeActivation.from_env({ENV_REQUIRE: "2"})


def test_os_environ_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_ENABLE, "1")
    monkeypatch.delenv(ENV_REQUIRE, raising=False)
    assert BridgeActivation.from_env() == BridgeActivation(enabled=True, require=False)


def test_importing_the_bridge_does_not_import_sglang() -> None:
    code = (
        "import sys; import kvledger.sglang.bridge, accounting, allocator; "
        "print(','.join(m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
