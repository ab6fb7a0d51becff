"""deploy/kubernetes: the manifests validate against the Kubernetes schemas, the Deployment probes and drains the
server the way `higgs-rt serve` works, and the autoscaler reads the metric the server exports."""

from __future__ import annotations

from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
K8S_VERSION = "1.30"


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def container() -> dict:
    return load("deployment.yaml")["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid_kubernetes(path):
    for doc in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_deployment_probes_health_and_asks_for_one_gpu():
    c = container()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health", probe
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 300  # a 3B model loads slowly


def test_the_server_arguments_parse_and_the_grace_period_covers_the_drain():
    from higgs_rt.cli import build_parser

    args = build_parser().parse_args(container()["args"])
    assert args.command == "serve" and args.host == "0.0.0.0" and args.allowed_hosts == ["*"]
    grace = load("deployment.yaml")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > args.shutdown_timeout + 5
    env = {e["name"]: e for e in container()["env"]}
    assert "secretKeyRef" in env["HIGGS_RT_API_KEY"]["valueFrom"]  # beyond loopback the server needs a key


def test_the_autoscaler_reads_the_servers_queue_gauge():
    from higgs_rt.metrics import QUEUE_DEPTH

    hpa = load("hpa.yaml")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == QUEUE_DEPTH
    rules = yaml.safe_load(load("prometheus-adapter-rules.yaml")["data"]["config.yaml"])["rules"]
    assert any(QUEUE_DEPTH in r["seriesQuery"] and r["name"]["as"] == QUEUE_DEPTH for r in rules)
    service, deployment = load("service.yaml"), load("deployment.yaml")
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
