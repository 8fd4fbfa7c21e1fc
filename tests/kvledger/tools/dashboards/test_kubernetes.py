"""The Kubernetes manifests `kvledger dashboards --out` writes (dashboards/kubernetes/): valid for
the Kubernetes API (kubernetes-validate's bundled schemas, strict: an unknown field fails) and for
the Prometheus Operator's ServiceMonitor CRD (its OpenAPI v3 schema, vendored under data/ with
its notice; unknown fields refused as the API server would prune them), consistent with each
other, under docs/security.md's rules, and `kvledger serve` runs with the DaemonSet's arguments."""

from __future__ import annotations

import copy
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import yaml

from kvledger import cli
from kvledger.tools.dashboards import kubernetes as k8s
from tests.kvledger.tools.dashboards import names
from tests.servers import repo_env, stop, wait_until

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="needs kubernetes-validate (pip install .[dev])"
)
CRD = (
    Path(__file__).parent
    / "data"
    / "prometheus-operator"
    / "monitoring.coreos.com_servicemonitors.yaml"
)
# The oldest Kubernetes release still maintained when this was written, and the newest the
# installed kubernetes-validate carries.
VERSIONS = ("1.31", kubernetes_validate.utils.latest_version())


def _load(rel: str) -> dict[str, Any]:
    return dict(yaml.safe_load((names.ROOT / rel).read_text()))


def _all() -> dict[str, dict[str, Any]]:
    return {rel: _load(rel) for rel in k8s.MANIFESTS}


def _container(ds: dict[str, Any]) -> dict[str, Any]:
    [c] = ds["spec"]["template"]["spec"]["containers"]
    return dict(c)


def _strict(schema: Any) -> Any:
    """The CRD schema with unknown fields refused: the API server prunes them silently,
    so a misspelt field would otherwise pass and do nothing."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _servicemonitor_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    [v1] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return dict(_strict(v1["schema"]["openAPIV3Schema"]))


def _servicemonitor_problems(doc: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(_servicemonitor_schema())
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)
    ]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("rel", ["kubernetes/daemonset.yml", "kubernetes/service.yml"])
def test_core_manifests_match_the_kubernetes_api(rel, version):
    kubernetes_validate.validate(_load(rel), version, strict=True)


def test_the_kubernetes_check_sees_a_misspelt_field():
    ds = _load("kubernetes/daemonset.yml")
    ctx = ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    ctx["readOnlyRootFileSystem"] = ctx.pop("readOnlyRootFilesystem")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, VERSIONS[-1], strict=True)


def test_servicemonitor_matches_the_operators_crd():
    sm = _load("kubernetes/servicemonitor.yml")
    crd = yaml.safe_load(CRD.read_text())
    assert sm["apiVersion"] == f"{crd['spec']['group']}/v1"
    assert sm["kind"] == crd["spec"]["names"]["kind"]
    assert _servicemonitor_problems(sm) == []


@pytest.mark.parametrize(
    ("path", "bad", "expected"),
    [
        (("spec", "endpoints", 0, "intervall"), "5s", "'intervall' was unexpected"),
        (("spec", "endpoints", 0, "interval"), "5 seconds", "does not match"),
        (("spec", "endpoints", 0, "relabelings", 0, "action"), "Rename", "is not one of"),
        (("spec", "selector", "matchLabels"), ["x"], "is not of type 'object'"),
    ],
)
def test_the_crd_check_sees_a_bad_field(path, bad, expected):
    sm = _load("kubernetes/servicemonitor.yml")
    node: Any = sm
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    found = _servicemonitor_problems(sm)
    assert any(expected in p for p in found), found


def test_they_fit_together():
    ds, svc, sm = (_all()[rel] for rel in k8s.MANIFESTS)
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    [port] = _container(ds)["ports"]
    [svc_port] = svc["spec"]["ports"]
    assert svc_port["targetPort"] == port["name"] and svc_port["port"] == port["containerPort"]
    [endpoint] = sm["spec"]["endpoints"]
    assert endpoint["port"] == svc_port["name"] and endpoint["path"] == "/metrics"
    # the Kubernetes SD job of prometheus-kubernetes.yml keeps pods by this port name too
    assert f"regex: {port['name']}\n" in (names.PROM / "prometheus-kubernetes.yml").read_text()
    # KvLedgerExporterDown selects job=~"kvledger.*": the Operator names the job after the Service
    assert svc["metadata"]["name"].startswith("kvledger")


def test_the_exporter_follows_the_security_rules():
    ds = _load("kubernetes/daemonset.yml")
    pod = ds["spec"]["template"]["spec"]
    c = _container(ds)
    ctx = c["securityContext"]
    assert ctx["allowPrivilegeEscalation"] is False and ctx["privileged"] is False
    assert ctx["readOnlyRootFilesystem"] is True and ctx["capabilities"] == {"drop": ["ALL"]}
    assert ctx["runAsUser"] == k8s.ENGINE_UID == ctx["runAsGroup"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for forbidden in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod.get(forbidden), forbidden
    assert pod["automountServiceAccountToken"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    # the snapshot directory: a hostPath the kubelet creates root-owned 0755, read-only here
    args = cli.build_parser("serve").parse_args(c["command"][1:] + c["args"])
    assert volumes["snapshots"]["hostPath"] == {
        "path": args.snapshot_dir,
        "type": "DirectoryOrCreate",
    }
    assert mounts["snapshots"] == {
        "name": "snapshots",
        "mountPath": args.snapshot_dir,
        "readOnly": True,
    }
    assert not args.snapshot_dir_group_writable and args.no_demo
    # the token: a Secret file only its owner reads, where --token-file points
    assert os.path.dirname(args.token_file) == mounts["token"]["mountPath"]
    assert mounts["token"]["readOnly"] is True
    assert volumes["token"]["secret"]["defaultMode"] & 0o077 == 0
    # every other writable mount is a small memory emptyDir
    for name, mount in mounts.items():
        if not mount.get("readOnly"):
            assert volumes[name]["emptyDir"]["medium"] == "Memory", name
    assert args.host == "0.0.0.0" and args.port == k8s.PORT and args.token_file


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_kvledger_serve_runs_with_the_daemonsets_arguments(tmp_path):
    """The container's command line, paths moved under tmp_path: a root-owned-style directory
    (this user's, 0755), a 0400 token file reached through a link as a Secret mount makes it;
    /metrics answers on the pod's port, /debug/kv wants the token."""
    c = _container(_load("kubernetes/daemonset.yml"))
    snap = tmp_path / "run-kvledger"
    snap.mkdir(mode=0o755)
    os.chmod(snap, 0o755)
    secret = tmp_path / "etc-kvledger"
    (secret / "..data").mkdir(parents=True)
    (secret / "..data" / "token").write_text("s3cret-token\n")
    os.chmod(secret / "..data" / "token", 0o400)
    (secret / "token").symlink_to("..data/token")
    port = _free_port()
    moved = {
        k8s.SNAPSHOT_DIR: str(snap),
        f"{k8s.TOKEN_DIR}/token": str(secret / "token"),
        str(k8s.PORT): str(port),
    }
    argv = [moved.get(a, a) for a in c["args"]]
    assert argv.count(str(port)) == 1 and str(snap) in argv
    kvledger = shutil.which("kvledger", path=os.path.dirname(sys.executable))
    command = [kvledger] if kvledger else [sys.executable, "-m", "kvledger"]
    proc = subprocess.Popen(
        [*command, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=repo_env()
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(f"{base}/healthz", timeout=2).status_code == 200, 60, "up")
        assert httpx.get(f"{base}/metrics", timeout=5).status_code == 200
        assert httpx.get(f"{base}/debug/kv", timeout=5).status_code == 401
        ok = httpx.get(
            f"{base}/debug/kv", headers={"Authorization": "Bearer s3cret-token"}, timeout=5
        )
        assert ok.status_code == 200
    finally:
        stop(proc)
    assert stat.S_IMODE(snap.stat().st_mode) == 0o755 and list(snap.iterdir()) == []


def test_the_readme_says_how_to_deploy_it():
    readme = (names.ROOT / "README.md").read_text()
    for needle in (
        "kubectl create secret generic kvledger-token",
        "kubectl apply -n",
        "kubectl create configmap kvledger-dashboards",
        'grafana_dashboard: "1"',
        f"{k8s.SNAPSHOT_DIR}",
        "KVLEDGER_SNAPSHOT_DIR",
        "sglang_kv_cache_memory_usage_gb",
    ):
        assert needle in readme, needle


def test_manifests_are_copies_of_the_generator():
    for rel, make in k8s.MANIFESTS.items():
        assert _load(rel) == copy.deepcopy(make()), rel
