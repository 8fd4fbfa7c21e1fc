"""kvledger.engines.sglang.switches: the wing's environment variables and what they mean (no sglang)."""

from __future__ import annotations

import pytest

from kvledger.engines.sglang import switches
from kvledger.engines.sglang.switches import BRIDGE_ENABLE as ENV_ENABLE
from kvledger.engines.sglang.switches import BRIDGE_REQUIRE as ENV_REQUIRE
from kvledger.engines.sglang.switches import BridgeActivation


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


def test_the_plugin_switch_and_its_require() -> None:
    assert switches.plugin_enabled({switches.PLUGIN_ENABLE: "1"})
    assert not switches.plugin_enabled({})
    with pytest.raises(ValueError, match="KVLEDGER_SGLANG='maybe'"):
        switches.plugin_enabled({switches.PLUGIN_ENABLE: "maybe"})
    assert not switches.plugin_required({})
    assert switches.plugin_required({switches.PLUGIN_REQUIRE: "yes"})
    assert switches.plugin_required({switches.PLUGIN_REQUIRE: "maybe"})  # not a "no"


def test_the_names_are_the_documented_ones() -> None:
    doc = switches.__doc__ or ""
    names = [v for k, v in vars(switches).items() if k.isupper() and isinstance(v, str)]
    assert len(names) == 9
    for name in names:
        assert f"    {name}=" in doc, f"{name} is not in the module's list"


def test_the_plugin_and_the_bridge_export_the_same_names() -> None:
    from kvledger.engines.sglang import bridge, plugin

    assert plugin.ENV_ENABLE == switches.PLUGIN_ENABLE == "KVLEDGER_SGLANG"
    assert plugin.ENV_REQUIRE == switches.PLUGIN_REQUIRE
    assert plugin.switch is switches.switch  # the one parser, accounting.switches.switch
    assert bridge.ENV_ENABLE == ENV_ENABLE == "KVLEDGER_SGLANG_DSV4_BRIDGE"
    assert bridge.ENV_REQUIRE == ENV_REQUIRE
    assert bridge.BridgeActivation is BridgeActivation


def test_compaction_is_on_unless_its_switch_says_off() -> None:
    assert switches.compaction_enabled({})
    assert switches.compaction_enabled({switches.COMPACT: " "})
    assert switches.compaction_enabled({switches.COMPACT: "1"})
    for off in ("0", "false", "no", "off"):
        assert not switches.compaction_enabled({switches.COMPACT: off})
    with pytest.raises(ValueError, match="KVLEDGER_SGLANG_DSV4_COMPACT='later'"):
        switches.compaction_enabled({switches.COMPACT: "later"})


def test_the_compaction_slack_is_a_count_of_page_ids() -> None:
    assert switches.compaction_slack({}) == switches.DEFAULT_COMPACT_SLACK == 2
    assert switches.compaction_slack({switches.COMPACT_SLACK: " "}) == 2
    assert switches.compaction_slack({switches.COMPACT_SLACK: "0"}) == 0
    assert switches.compaction_slack({switches.COMPACT_SLACK: " 2 "}) == 2
    top = switches.MAX_COMPACT_SLACK
    assert switches.compaction_slack({switches.COMPACT_SLACK: str(top)}) == top
    for bad in ("-1", "1.5", "two", "0x2", str(top + 1), "9" * 400, "\u0662"):
        with pytest.raises(ValueError, match=f"{switches.COMPACT_SLACK}=.*expected a whole"):
            switches.compaction_slack({switches.COMPACT_SLACK: bad})


def test_a_long_bad_slack_is_cut_in_the_message() -> None:
    with pytest.raises(ValueError) as e:
        switches.compaction_slack({switches.COMPACT_SLACK: "x" * 10_000})
    assert len(str(e.value)) < 200


def test_sglangs_mem_usage_is_fixed_unless_the_native_switch_is_on() -> None:
    assert switches.mem_usage_fixed({})
    assert not switches.mem_usage_fixed({switches.NATIVE_MEM_USAGE: "1"})
    assert switches.mem_usage_fixed({switches.NATIVE_MEM_USAGE: "off"})
    with pytest.raises(ValueError, match=switches.NATIVE_MEM_USAGE):
        switches.mem_usage_fixed({switches.NATIVE_MEM_USAGE: "sometimes"})
