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
        footprints = s.name == PREFIX + "request_slots"  # the one histogram
        assert s.type == ("histogram" if footprints else "gauge"), s.name
        assert s.name.startswith(PREFIX) and not s.engine, s.name
        assert s.labels[:2] == ("model_name", "engine"), s.name
        grouped = s.name.startswith(PREFIX + "group_") or footprints
        assert ("group" in s.labels) == grouped, s.name
        if grouped:  # group and kind together, after vLLM's labels; a holder after them
            at = s.labels.index("group")
            assert s.labels[at : at + 2] == ("group", "kind"), s.name
            assert s.labels[at + 2 :] in ((), ("holder",)), s.name
