"""Kubernetes manifests for a cluster: `kvledger serve` on every GPU node, its Service, and a
ServiceMonitor for the Prometheus Operator.

The snapshot directory follows docs/security.md. It is a hostPath directory, `/run/kvledger`
on each node, which the kubelet creates owned by root, mode 0755 (type `DirectoryOrCreate`):
owned by the engines' uid (root: SGLang's images run as root) and writable by nobody else.
The engine pods on the node mount it read-write and publish into it; the exporter mounts
it read-only and runs as that same uid (so the engines' 0600 files are its own), with no
capability at all (root without CAP_DAC_OVERRIDE reads only what it owns), no privilege
escalation, a read-only root filesystem and the runtime's default seccomp profile. It
binds all addresses of its pod, so `/debug/*` needs the bearer token, mounted from the
Secret `kvledger-token` as a 0400 file. No host network: the exporter's hostname differs
from an engine's, so the exporter judges a silent engine by its heartbeat, not by a pid
that its own PID namespace cannot see.

Engines of another uid N: set `runAsUser: N` in both pod specs and prepare the directory
owned by N, mode 0755, on each node (the output README says how).
"""

from __future__ import annotations

from typing import Any

from kvledger import __version__

NAME = "kvledger"
PORT = 9400
PORT_NAME = "kvledger"  # also what prometheus-kubernetes.yml keeps: a container port named kvledger
SNAPSHOT_DIR = "/run/kvledger"
TOKEN_DIR = "/etc/kvledger"
TOKEN_SECRET = "kvledger-token"
ENGINE_UID = 0
IMAGE = f"kvledger:{__version__}"  # built by you: pip install kvledger into a Python image
LABELS = {"app.kubernetes.io/name": NAME, "app.kubernetes.io/component": "exporter"}
SELECTOR = {"app.kubernetes.io/name": NAME}
# NVIDIA's GPU feature discovery (and the GPU operator) label GPU nodes so; dcgm-exporter's
# chart selects the same nodes.
GPU_NODE_SELECTOR = {"nvidia.com/gpu.present": "true"}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def serve_args() -> list[str]:
    """The exporter's command line (after `kvledger`): the directory alone, no demo."""
    return [
        "serve",
        "--no-demo",
        "--snapshot-dir",
        SNAPSHOT_DIR,
        "--host",
        "0.0.0.0",
        "--port",
        str(PORT),
        "--token-file",
        f"{TOKEN_DIR}/token",
        # memory given back after many sources come and go (the image installs libjemalloc2)
        "--malloc",
        "jemalloc",
    ]


def _probe(path: str, period: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": 3,
    }


def daemonset() -> dict[str, Any]:
    container = {
        "name": NAME,
        "image": IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "command": ["kvledger"],
        "args": serve_args(),
        "ports": [{"name": PORT_NAME, "containerPort": PORT, "protocol": "TCP"}],
        # /healthz, not /readyz, for readiness too: /readyz waits for a live engine, and a GPU
        # node without one must still be scraped (kvledger_up) and must not stall a rollout.
        "startupProbe": {**_probe("/healthz", 2), "failureThreshold": 30},
        "readinessProbe": _probe("/healthz", 5),
        "livenessProbe": _probe("/healthz", 10),
        "resources": {
            "requests": {"cpu": "50m", "memory": "128Mi"},
            "limits": {"memory": "512Mi"},
        },
        "securityContext": {
            "runAsUser": ENGINE_UID,
            "runAsGroup": ENGINE_UID,
            "privileged": False,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "snapshots", "mountPath": SNAPSHOT_DIR, "readOnly": True},
            {"name": "token", "mountPath": TOKEN_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    pod = {
        "nodeSelector": dict(GPU_NODE_SELECTOR),
        "tolerations": [dict(GPU_TOLERATION)],
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [
            {"name": "snapshots", "hostPath": {"path": SNAPSHOT_DIR, "type": "DirectoryOrCreate"}},
            {
                "name": "token",
                "secret": {
                    "secretName": TOKEN_SECRET,
                    "defaultMode": 0o400,
                    "items": [{"key": "token", "path": "token"}],
                },
            },
            {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}},
        ],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": NAME, "labels": dict(LABELS)},
        "spec": {
            "selector": {"matchLabels": dict(SELECTOR)},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {"metadata": {"labels": dict(LABELS)}, "spec": pod},
        },
    }


def service() -> dict[str, Any]:
    """Headless: the ServiceMonitor scrapes each exporter pod, never one behind a VIP."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": NAME, "labels": dict(LABELS)},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": dict(SELECTOR),
            "ports": [
                {"name": PORT_NAME, "port": PORT, "targetPort": PORT_NAME, "protocol": "TCP"}
            ],
        },
    }


def servicemonitor() -> dict[str, Any]:
    """The Operator scrapes every endpoint of the Service as job `kvledger` (the Service's
    name), every 5 s like prometheus.yml's job, with the node's name as label `node`."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": NAME, "labels": dict(LABELS)},
        "spec": {
            "selector": {"matchLabels": dict(SELECTOR)},
            "endpoints": [
                {
                    "port": PORT_NAME,
                    "path": "/metrics",
                    "scheme": "http",
                    "interval": "5s",
                    "scrapeTimeout": "5s",
                    "relabelings": [
                        {
                            "action": "replace",
                            "sourceLabels": ["__meta_kubernetes_pod_node_name"],
                            "targetLabel": "node",
                        }
                    ],
                }
            ],
        },
    }


MANIFESTS = {
    "kubernetes/daemonset.yml": daemonset,
    "kubernetes/service.yml": service,
    "kubernetes/servicemonitor.yml": servicemonitor,
}
