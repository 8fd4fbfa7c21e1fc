"""The DeepSeek-V4-Flash-shaped and V4.1-shaped configs the tests use: the fields SGLang reads
for KV sizing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvledger.engines.sglang.dsv4 import Dsv4Shape, load_config

FLASH_CONFIG = (
    Path(__file__).resolve().parents[5]
    / "kvledger"
    / "data"
    / "deepseek-v4-flash-shape.config.json"
)
V41_CONFIG = FLASH_CONFIG.with_name("deepseek-v41-shape.config.json")


def flash_config_dict() -> dict[str, Any]:
    with open(FLASH_CONFIG, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def flash() -> Dsv4Shape:
    return load_config(FLASH_CONFIG)


def v41() -> Dsv4Shape:
    return load_config(V41_CONFIG)
