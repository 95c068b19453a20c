"""The Kubernetes manifests (infra/k8s), rendered, against the worker they run: the
config in the ConfigMap is one the worker accepts, and the ports, probe paths, drain
deadline, scraped metrics and the consumer group KEDA watches are the worker's own."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY

import streams.metrics  # noqa: F401  (registers the worker's metrics)
from streams.config import HeadraceConfig, parse_config
from streams.health import LIVE_PATH, READY_PATH
from tests.infra.kustomize import render, render_in_python

K8S = Path(__file__).resolve().parents[2] / "infra" / "k8s"
FOLDERS = [K8S / "base", K8S / "overlays" / "example"]


def by_kind(docs: list[dict]) -> dict[str, dict]:
    kinds = {doc["kind"]: doc for doc in docs}
    assert len(kinds) == len(docs), "one resource of each kind"
    return kinds


def worker_config(configmap: dict) -> HeadraceConfig:
    (text,) = configmap["data"].values()
    return parse_config(yaml.safe_load(text), "the ConfigMap's headrace.yaml")


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda folder: folder.name)
def test_the_manifests_fit_the_worker_they_run(folder):
    kinds = by_kind(render(folder))
    assert set(kinds) == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget",
                          "PodMonitor", "ScaledObject"}  # fmt: skip
    config = worker_config(kinds["ConfigMap"])
    deployment = kinds["Deployment"]
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    (container,) = pod["spec"]["containers"]

    # The config file the worker reads is the ConfigMap's.
    (mount,) = container["volumeMounts"]
    (volume,) = pod["spec"]["volumes"]
    assert volume["configMap"]["name"] == kinds["ConfigMap"]["metadata"]["name"]
    (file_name,) = kinds["ConfigMap"]["data"]
    config_path = f"{mount['mountPath']}/{file_name}"
    assert container["args"] == ["worker", "-c", config_path]
    assert {"name": "HEADRACE_CONFIG", "value": config_path} in container["env"]

    # Probes and scraping on the worker's metrics port and paths.
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"metrics": config.metrics.port}
    assert container["livenessProbe"]["httpGet"] == {"path": LIVE_PATH, "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": READY_PATH, "port": "metrics"}
    assert container["livenessProbe"]["timeoutSeconds"] > config.health.loop_timeout_ms / 1000
    (endpoint,) = kinds["PodMonitor"]["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
    assert kinds["PodMonitor"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    kept = re.compile(
        next(r["regex"] for r in endpoint["metricRelabelings"] if r["action"] == "keep")
    )
    exported = [m.name for m in REGISTRY.collect() if m.name.startswith("headrace_")]
    assert exported and all(kept.fullmatch(name) for name in exported)
    service = kinds["Service"]["spec"]
    assert service["selector"].items() <= labels.items()
    assert [p["targetPort"] for p in service["ports"]] == ["metrics"]

    # The worker drains by itself before Kubernetes would SIGKILL it.
    assert pod["spec"]["terminationGracePeriodSeconds"] > config.drain_timeout_s
    assert kinds["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert container["resources"]["requests"]["cpu"]

    # KEDA watches the workers' own group, brokers and input topics.
    scaled = kinds["ScaledObject"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    triggers = scaled["spec"]["triggers"]
    assert {t["type"] for t in triggers} == {"kafka"}
    assert sorted(t["metadata"]["topic"] for t in triggers) == sorted(
        spec.input_topic for spec in config.pipelines
    )
    for trigger in triggers:
        metadata = trigger["metadata"]
        assert metadata["consumerGroup"] == config.app_id
        assert metadata["bootstrapServers"] == config.broker.bootstrap_servers
        assert int(metadata["lagThreshold"]) > 0
    partitions = int(scaled["metadata"]["annotations"]["headrace/input-partitions"])
    assert scaled["spec"]["maxReplicaCount"] == partitions


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="compares with kubectl's render")
@pytest.mark.parametrize("folder", FOLDERS, ids=lambda folder: folder.name)
def test_the_python_render_equals_kubectl_kustomize(folder):
    def unhashed(docs: list[dict]) -> dict[str, dict]:
        text = yaml.safe_dump(by_kind(docs), sort_keys=True)
        return yaml.safe_load(re.sub(r"(headrace-config)-[a-z0-9]{10}", r"\1", text))

    assert unhashed(render_in_python(folder)) == unhashed(render(folder))
