"""README.md's figure table is the one generated from accounting.figures."""

from pathlib import Path

from accounting.figures import markdown_table


def test_readme_figure_table_is_generated_from_the_figures_table() -> None:
    text = (Path(__file__).parents[1] / "README.md").read_text()
    block = text.split("<!-- figures:begin -->\n", 1)[1].split("\n<!-- figures:end -->", 1)[0]
    assert block == markdown_table()
