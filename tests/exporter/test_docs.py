"""docs/metrics.md's table is the one generated from exporter.metrics."""

from pathlib import Path

from exporter.metrics import markdown_table


def test_docs_metric_table_is_generated_from_the_metric_table() -> None:
    text = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    block = text.split("<!-- metrics:begin -->\n", 1)[1].split("\n<!-- metrics:end -->", 1)[0]
    assert block == markdown_table()
