"""The Grafana dashboard, its provisioning, and Prometheus's scrape configs and rules.

`kvledger dashboards --out DIR` writes them from the installed package
(`files`); the repository's `dashboards/` folder is that output, kept equal by
`--check` and tests/kvledger/tools/dashboards/. Everything a panel or a rule queries is built
from `exporter.metrics.METRICS` (the exporter's one metric table) and
`accounting.figures.FIGURES`, so renaming a metric or a figure changes the
generated files, and the tests fail until they are regenerated.

Modules: `promql` (names a query uses), `yamlfile` (YAML through PyYAML),
`grafana` (panel and dashboard JSON), `rules` (recording and alerting rules),
`kv_dashboard` (the KV-cache dashboard itself), `kubernetes` (a DaemonSet, Service
and ServiceMonitor for a cluster), `files` (what goes where,
generated or copied from `templates/`), `command` (the subcommand).
"""

from kvledger.engines.exports import register_all

register_all()  # the table the panels are checked against holds vLLM's metrics too
