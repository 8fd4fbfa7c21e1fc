"""README.md's figure table is the one generated from accounting.figures."""

import subprocess
import sys
from pathlib import Path

from accounting.figures import holders_markdown_table, markdown_table


def test_readme_figure_table_is_generated_from_the_figures_table() -> None:
    text = (Path(__file__).parents[1] / "README.md").read_text()
    block = text.split("<!-- figures:begin -->\n", 1)[1].split("\n<!-- figures:end -->", 1)[0]
    assert block == markdown_table()


def test_python_m_accounting_prints_the_table_and_nothing_else() -> None:
    r = subprocess.run(
        [sys.executable, "-W", "error", "-m", "accounting"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
        timeout=60,
        check=False,
    )
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout == markdown_table() + "\n"


def test_readme_holder_table_is_generated_from_the_holders_table() -> None:
    text = (Path(__file__).parents[1] / "README.md").read_text()
    block = text.split("<!-- holders:begin -->\n", 1)[1].split("\n<!-- holders:end -->", 1)[0]
    assert block == holders_markdown_table()
