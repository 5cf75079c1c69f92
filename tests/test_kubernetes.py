"""deploy/kubernetes/: every overlay rendered by the real `kubectl kustomize`,
each resource validated against the Kubernetes 1.33 schemas (strict: no field
the API would drop), then what the schemas cannot see: every `epd` command
parses with the flags its parser accepts, every Triton flag names what the
model repository holds, every Service and budget selects a pod, every probe
targets a port its container serves, every autoscaler a Deployment that
exists, and no secret is written into a resource."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from services.launcher.cli import parse_args
from services.launcher.protogen import REPO_ROOT

KUBE = REPO_ROOT / "deploy" / "kubernetes"
OVERLAYS = ["cpu", "gpu", "gpu-epd", "cpu+monitoring"]
VERSION = "1.33.0"
# Custom resources: no schema in kubernetes-validate's set, checked by hand below.
CUSTOM = {"ServiceMonitor"}

Resource = dict[str, Any]


def kustomize(directory: Path) -> list[Resource]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (scripts/setup.sh installs Debian's where it can)")
    rendered = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, check=False
    )
    assert rendered.returncode == 0, rendered.stderr
    return [r for r in yaml.safe_load_all(rendered.stdout) if r]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[Resource]:
    name: str = request.param
    if name == "cpu+monitoring":  # the optional component, taken as a user would
        overlay = tmp_path_factory.mktemp("overlay")
        cpu = os.path.relpath(KUBE / "overlays" / "cpu", overlay)  # Kustomize takes no absolute
        monitoring = os.path.relpath(KUBE / "components" / "monitoring", overlay)
        (overlay / "kustomization.yaml").write_text(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
            f"resources:\n  - {cpu}\ncomponents:\n  - {monitoring}\n"
        )
        return kustomize(overlay)
    return kustomize(KUBE / "overlays" / name)


def pods(resources: list[Resource]) -> list[tuple[str, Resource]]:
    """Each Deployment's pod template: (the Deployment's name, the template)."""
    return [
        (r["metadata"]["name"], r["spec"]["template"])
        for r in resources
        if r["kind"] == "Deployment"
    ]


def containers(template: Resource) -> list[Resource]:
    spec = template["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def test_every_resource_is_valid_for_kubernetes_1_33(rendered: list[Resource]) -> None:
    for resource in rendered:
        if resource["kind"] in CUSTOM:
            continue
        try:
            kubernetes_validate.validate(resource, VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(
                f"{resource['kind']} {resource['metadata']['name']}: {exc}"
            ) from None


def test_the_service_monitor_scrapes_the_metrics_services(rendered: list[Resource]) -> None:
    monitors = [r for r in rendered if r["kind"] == "ServiceMonitor"]
    metrics = [
        r
        for r in rendered
        if r["kind"] == "Service"
        and r["metadata"].get("labels", {}).get("epd.dev/metrics") == "true"
    ]
    for monitor in monitors:  # only where the component was taken
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["spec"]["selector"]["matchLabels"] == {"epd.dev/metrics": "true"}
        names = {e["port"] for e in monitor["spec"]["endpoints"]}
        assert {p["name"] for s in metrics for p in s["spec"]["ports"]} <= names
    assert {s["metadata"]["name"] for s in metrics} >= {"epd-gateway", "epd-encoder-metrics"}


@pytest.fixture(autouse=True)
def configured(rendered: list[Resource], monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment the pods get from the ConfigMap, as the parsers read it."""
    for config in (r for r in rendered if r["kind"] == "ConfigMap"):
        for name, value in config["data"].items():
            monkeypatch.setenv(name, value)


def test_every_epd_command_parses(rendered: list[Resource]) -> None:
    seen = set()
    for deployment, template in pods(rendered):
        for container in containers(template):
            command = [arg.replace("$(POD_IP)", "10.0.0.7") for arg in container["command"]]
            if command[0] == "tritonserver":
                check_triton(command)
                continue
            assert command[0] == "epd", f"{deployment}/{container['name']}: {command}"
            try:
                parse_args(command[1:])
            except SystemExit:
                raise AssertionError(
                    f"{deployment}/{container['name']}: epd {command[1:]}"
                ) from None
            seen.add(command[1])
    assert {"broker", "encoder", "language", "gateway"} <= seen


def triton_flags(command: list[str]) -> dict[str, str]:
    """tritonserver's --flag=value arguments ("" for a bare --flag)."""
    return {k: v for k, _, v in (arg.removeprefix("--").partition("=") for arg in command[1:])}


def check_triton(command: list[str]) -> None:
    flags = triton_flags(command)
    assert flags["model-repository"] == "/opt/epd/model_repository"  # docker/triton.Dockerfile
    repository = REPO_ROOT / "model_repository"
    assert (repository / flags["load-model"] / "config.pbtxt").exists()
    if "model-config-name" in flags:
        assert (
            repository / flags["load-model"] / "configs" / f"{flags['model-config-name']}.pbtxt"
        ).exists()


def test_every_service_and_budget_selects_a_pod(rendered: list[Resource]) -> None:
    labels = [template["metadata"]["labels"] for _, template in pods(rendered)]

    def selects(selector: dict[str, str]) -> bool:
        return any(selector.items() <= pod.items() for pod in labels)

    for resource in rendered:
        if resource["kind"] == "Service":
            assert selects(resource["spec"]["selector"]), resource["metadata"]["name"]
        if resource["kind"] == "PodDisruptionBudget":
            assert selects(resource["spec"]["selector"]["matchLabels"]), resource["metadata"][
                "name"
            ]
    deployments = {name for name, _ in pods(rendered)}
    for scaler in (r for r in rendered if r["kind"] == "HorizontalPodAutoscaler"):
        assert scaler["spec"]["scaleTargetRef"]["name"] in deployments


def served_ports(container: Resource) -> set[int]:
    """The ports the container's own command line says it listens on."""
    command = [arg.replace("$(POD_IP)", "10.0.0.7") for arg in container["command"]]
    if command[0] == "tritonserver":
        flags = triton_flags(command)
        return {int(flags[f]) for f in ("http-port", "grpc-port", "metrics-port")}
    args = parse_args(command[1:])
    return {p for p in (getattr(args, "port", None), getattr(args, "metrics_port", None)) if p}


def test_every_probe_and_port_is_one_the_container_serves(rendered: list[Resource]) -> None:
    for deployment, template in pods(rendered):
        for container in template["spec"]["containers"]:
            serves = served_ports(container)
            declared = {p["containerPort"] for p in container.get("ports", [])}
            assert declared <= serves, f"{deployment}/{container['name']}: {declared} vs {serves}"
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = container.get(kind)
                if probe is None:
                    continue
                port = next(
                    probe[k]["port"] for k in ("grpc", "httpGet", "tcpSocket") if k in probe
                )
                assert port in serves, f"{deployment}/{container['name']} {kind} on {port}"
            assert "readinessProbe" in container, f"{deployment}/{container['name']}"


def test_secrets_are_referenced_never_written(rendered: list[Resource]) -> None:
    assert not [r for r in rendered if r["kind"] == "Secret"]
    referenced = set()
    for deployment, template in pods(rendered):
        for container in containers(template):
            for variable in container.get("env", []):
                name = variable["name"]
                if name in ("EPD_CLUSTER_TOKEN", "EPD_API_KEY") or "SECRET" in name:
                    ref = variable.get("valueFrom", {}).get("secretKeyRef")
                    assert ref is not None and "value" not in variable, f"{deployment}: {name}"
                    referenced.add(ref["name"])
    assert referenced == {"epd-cluster-token", "epd-api-key"}
    config = next(r for r in rendered if r["kind"] == "ConfigMap")
    assert not any("TOKEN" in k or "KEY" in k for k in config["data"])


def test_only_the_gateway_takes_outside_traffic(rendered: list[Resource]) -> None:
    policies = {r["metadata"]["name"]: r["spec"] for r in rendered if r["kind"] == "NetworkPolicy"}
    internal = policies["epd-internal"]
    roles = {template["metadata"]["labels"]["epd.dev/role"] for _, template in pods(rendered)} - {
        "gateway"
    }
    assert roles <= set(internal["podSelector"]["matchExpressions"][0]["values"])
    for rule in internal["ingress"]:  # from EPD's pods, or Prometheus to the metrics ports
        source = rule["from"][0]["podSelector"]["matchLabels"]
        assert source in (
            {"app.kubernetes.io/part-of": "epd"},
            {"app.kubernetes.io/name": "prometheus"},
        )
    assert [p["port"] for p in policies["epd-gateway"]["ingress"][0]["ports"]] == [8000]
    for deployment, template in pods(rendered):  # what "EPD's own pods" selects
        assert template["metadata"]["labels"]["app.kubernetes.io/part-of"] == "epd", deployment


def test_a_restarted_encoder_removes_the_regions_its_predecessor_left(
    rendered: list[Resource],
) -> None:
    """The encoder's regions for Triton live in the pod's /dev/shm, a memory
    emptyDir that outlives a container restart: the encoder names them under a
    prefix of its own and reclaims it at start."""
    encoders = 0
    for deployment, template in pods(rendered):
        for container in template["spec"]["containers"]:
            if container.get("command", [])[:2] != ["epd", "encoder"]:
                continue
            encoders += 1
            env = {v["name"]: v.get("value") for v in container.get("env", [])}
            assert env.get("EPD_SHM_RECLAIM") == "1", deployment
            assert (env.get("EPD_SHM_PREFIX") or "").startswith("epd_encoder"), deployment
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == mounts["/dev/shm"]]
            assert volume["emptyDir"]["medium"] == "Memory", deployment
    assert encoders
