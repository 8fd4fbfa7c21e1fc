"""`python -m accounting`: print the figures table as Markdown (README.md embeds it)."""

from accounting.figures import markdown_table

print(markdown_table())
