"""Grafana provisioning files agree with the generated dashboard: the data source uid the
dashboard defaults to, and the folder the provider loads."""

from __future__ import annotations

import re

from kvledger.dashboards import files, kv_dashboard
from tests.dashboards import names

PROVISIONING = names.ROOT / "grafana" / "provisioning"


def test_datasource_uid_is_the_dashboards_default():
    text = (PROVISIONING / "datasources" / "kvledger.yml").read_text()
    assert re.search(r"^\s+uid: (\S+)$", text, re.M).group(1) == kv_dashboard.PROVISIONED_DATASOURCE
    assert re.search(r"^\s+type: prometheus$", text, re.M)
    var = kv_dashboard.dashboard().to_json()["templating"]["list"][0]
    assert var["current"]["value"] == kv_dashboard.PROVISIONED_DATASOURCE


def test_provider_loads_the_generated_dashboards_folder():
    text = (PROVISIONING / "dashboards" / "kvledger.yml").read_text()
    path = re.search(r"^\s+path: (\S+)$", text, re.M).group(1)
    dashboards = [rel for rel in files.GENERATED if rel.endswith(".json")]
    assert dashboards
    for rel in dashboards:
        folder = rel.rsplit("/", 1)[0]
        assert path.endswith("/" + folder), (path, rel)
    mount = path.removesuffix("/" + "grafana/dashboards")
    assert f"GF_PATHS_PROVISIONING={mount}/grafana/provisioning" in text
