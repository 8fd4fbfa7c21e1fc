"""Grafana provisioning files agree with the generated dashboard: the data source uid the
dashboard defaults to, and the folder the provider loads."""

from __future__ import annotations

import yaml

from kvledger.tools.dashboards import files, kv_dashboard
from tests.kvledger.tools.dashboards import names

PROVISIONING = names.ROOT / "grafana" / "provisioning"


def test_datasource_uid_is_the_dashboards_default():
    doc = yaml.safe_load((PROVISIONING / "datasources" / "kvledger.yml").read_text())
    [source] = doc["datasources"]
    assert (doc["apiVersion"], source["type"]) == (1, "prometheus")
    assert source["uid"] == kv_dashboard.PROVISIONED_DATASOURCE
    assert source["url"] == "$KVLEDGER_PROMETHEUS_URL"
    var = kv_dashboard.dashboard().to_json()["templating"]["list"][0]
    assert var["current"]["value"] == kv_dashboard.PROVISIONED_DATASOURCE


def test_provider_loads_the_generated_dashboards_folder():
    text = (PROVISIONING / "dashboards" / "kvledger.yml").read_text()
    doc = yaml.safe_load(text)
    [provider] = doc["providers"]
    assert (doc["apiVersion"], provider["type"]) == (1, "file")
    path = provider["options"]["path"]
    dashboards = [rel for rel in files.GENERATED if rel.endswith(".json")]
    assert dashboards
    for rel in dashboards:
        folder = rel.rsplit("/", 1)[0]
        assert path.endswith("/" + folder), (path, rel)
    mount = path.removesuffix("/" + "grafana/dashboards")
    assert f"GF_PATHS_PROVISIONING={mount}/grafana/provisioning" in text
