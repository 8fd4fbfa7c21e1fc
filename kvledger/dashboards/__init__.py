"""The Grafana dashboard and Prometheus rules under `dashboards/`, generated from code.

`python -m kvledger.dashboards` writes them; `--check` exits non-zero when the
committed files differ from what the code generates. Everything a panel or a rule
queries is built from `exporter.metrics.METRICS` (the exporter's one metric table)
and `accounting.figures.FIGURES`, so renaming a metric or a figure changes the
generated files, and `tests/dashboards/` fails until they are regenerated.

Modules: `promql` (names a query uses), `yamlfile` (a small YAML writer),
`grafana` (panel and dashboard JSON), `rules` (recording and alerting rules),
`kv_dashboard` (the KV-cache dashboard itself), `files` (what goes where).
"""
