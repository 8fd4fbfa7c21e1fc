"""kvledger.engines.vllm.metrics: vLLM's metric table, and docs/vllm.md's copy of it."""

from pathlib import Path

from exporter.metrics import markdown_table
from kvledger.engines.vllm.metrics import METRICS, PREFIX

ROOT = Path(__file__).parents[4]


def test_docs_vllm_table_is_generated_from_the_table() -> None:
    text = (ROOT / "docs" / "vllm.md").read_text()
    block = text.split("<!-- vllm-metrics:begin -->\n", 1)[1]
    assert block.split("\n<!-- vllm-metrics:end -->", 1)[0] == markdown_table(METRICS)


def test_every_name_is_under_the_prefix_with_vllms_labels_first() -> None:
    assert METRICS and len({s.name for s in METRICS}) == len(METRICS)
    for s in METRICS:
        assert s.name.startswith(PREFIX) and s.type == "gauge" and not s.engine, s.name
        assert s.labels[:2] == ("model_name", "engine"), s.name
        grouped = s.name.startswith(PREFIX + "group_")
        assert (s.labels[-2:] == ("group", "kind")) == grouped, s.name
