"""Static checks that compose and the Kubernetes example put a node and its worker on the same-host data plane.

The node's handoff socket is ``<server.unix_socket>.shm``; a worker reaches it
(and so the shared-memory segments) only when it sees the socket's directory
at the same path, runs as the same user (the sockets are ``0660``), and the
node offers the path (``shared_memory.enabled``). Each file must give all
three, and ``KVSTORE_SHARED_MEMORY=false`` must turn it off as the docs say.
"""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any, Mapping

import pytest
import yaml

from kvstore.config import ENV_PREFIX, Config, load_config
from tests.support.deploy import (
    COMPOSE_FILE,
    CONFIG_FILE,
    DOCKERFILE,
    KUBERNETES_DIR,
    REPO_ROOT,
    final_stage,
    image_env,
    load_yaml_documents,
    parse_dockerfile,
)

RUN_DIR = "/run/kvstore"
SIDECAR_FILE = KUBERNETES_DIR / "worker-sidecar.example.yaml"


def _load(env: Mapping[str, str], path: Path) -> Config:
    return load_config(path, env={k: str(v) for k, v in env.items() if k.startswith(ENV_PREFIX)})


def _handoff_dir(config: Config) -> str:
    """The directory of the node's Unix socket and its handoff socket (the default ``<unix_socket>.shm``)."""
    assert config.server.unix_socket, "the node listens on no Unix socket: no handoff socket a worker can reach"
    assert not config.shared_memory.handoff_socket, "a custom handoff socket: check that it is shared too"
    return posixpath.dirname(config.server.unix_socket)


def _mount_paths(service: dict[str, Any]) -> dict[str, str]:
    """compose: mount path -> source (named volume or host path) of a service's volumes."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        mounts[target] = source
    return mounts


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def sidecar_pod() -> dict[str, Any]:
    (deployment,) = list(load_yaml_documents(SIDECAR_FILE))
    assert isinstance(deployment, dict) and deployment["kind"] == "Deployment"
    return deployment["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def k8s_file_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configmap = next(doc for doc in load_yaml_documents(KUBERNETES_DIR / "configmap.yaml")
                     if isinstance(doc, dict) and doc["metadata"]["name"] == "kvstore-config")
    path = tmp_path_factory.mktemp("k8s") / "kvstore.yaml"
    path.write_text(configmap["data"]["kvstore.yaml"])
    return path


def _k8s_env(container: dict[str, Any]) -> dict[str, str]:
    env = dict(image_env(parse_dockerfile(DOCKERFILE)))
    configmap = next(doc for doc in load_yaml_documents(KUBERNETES_DIR / "configmap.yaml")
                     if isinstance(doc, dict) and doc["metadata"]["name"] == "kvstore-env")
    env.update(configmap["data"])
    env.update({item["name"]: item["value"] for item in container.get("env", []) if "value" in item})
    return env


# -- the image ------------------------------------------------------------------------------


def test_the_image_makes_the_socket_directory_for_its_user() -> None:
    """A named volume mounted at /run/kvstore takes the ownership of the image's directory (compose)."""
    run = " ".join(i.value for i in final_stage(parse_dockerfile(DOCKERFILE)) if i.keyword == "RUN")
    assert RUN_DIR in run and "chown kvstore:kvstore" in run
    assert f"chmod 0750 {RUN_DIR}" in run, "only the kvstore user (and its group) may reach the sockets"


# -- compose --------------------------------------------------------------------------------


def test_compose_node_and_demo_worker_share_the_socket_directory(compose: dict) -> None:
    node, demo = compose["services"]["kvstore"], compose["services"]["demo"]
    config = _load(image_env(parse_dockerfile(DOCKERFILE)) | node["environment"], CONFIG_FILE)
    assert config.shared_memory.enabled
    directory = _handoff_dir(config)
    node_mounts, demo_mounts = _mount_paths(node), _mount_paths(demo)
    assert directory in node_mounts and demo_mounts.get(directory) == node_mounts[directory], (
        f"the demo worker must see the node's {directory} at the same path")
    assert node_mounts[directory] in compose["volumes"], "a named volume, not a host path"
    assert demo["build"]["dockerfile"] == node["build"]["dockerfile"] == "deploy/Dockerfile", (
        "one image's user (uid 10001) on both sides: the sockets are 0660")
    assert str(demo["environment"]["KVSTORE_SHARED_MEMORY"]).lower() == "true"


def test_compose_turns_off_with_kvstore_shared_memory_false(compose: dict) -> None:
    node = compose["services"]["kvstore"]
    env = image_env(parse_dockerfile(DOCKERFILE)) | node["environment"] | {"KVSTORE_SHARED_MEMORY": "false"}
    assert not _load(env, CONFIG_FILE).shared_memory.enabled
    assert 'KVSTORE_SHARED_MEMORY: "false"' in COMPOSE_FILE.read_text(), "the file says how to turn it off"


# -- Kubernetes -----------------------------------------------------------------------------


def test_k8s_sidecar_node_and_worker_share_the_socket_directory(sidecar_pod: dict, k8s_file_config: Path) -> None:
    containers = {c["name"]: c for c in sidecar_pod["containers"]}
    node, worker = containers["kvstore"], containers["worker"]
    config = _load(_k8s_env(node), k8s_file_config)
    assert config.shared_memory.enabled
    assert not config.store.disk.path, "a worker's sidecar keeps no disk tier (the file's path is overridden)"
    directory = _handoff_dir(config)
    mounts = {c: {m["mountPath"]: m["name"] for m in containers[c]["volumeMounts"]} for c in containers}
    assert mounts["kvstore"][directory] == mounts["worker"][directory]
    volume = next(v for v in sidecar_pod["volumes"] if v["name"] == mounts["kvstore"][directory])
    assert "emptyDir" in volume, "the pod's own directory, not a host path other pods could reach"
    assert sidecar_pod["securityContext"]["runAsUser"] == 10001
    assert all("runAsUser" not in c.get("securityContext", {}) for c in containers.values()), (
        "one user for both containers: the sockets are 0660")
    target = f"unix://{config.server.unix_socket}"
    assert worker["args"][worker["args"].index("--target") + 1] == target
    for probe in ("startupProbe", "livenessProbe"):
        assert target in node[probe]["exec"]["command"]


def test_k8s_sidecar_says_how_to_turn_it_off(sidecar_pod: dict, k8s_file_config: Path) -> None:
    node = next(c for c in sidecar_pod["containers"] if c["name"] == "kvstore")
    env = _k8s_env(node) | {"KVSTORE_SHARED_MEMORY": "false"}
    assert not _load(env, k8s_file_config).shared_memory.enabled
    assert 'KVSTORE_SHARED_MEMORY: "false"' in SIDECAR_FILE.read_text()


def test_the_docs_say_how_to_turn_it_off() -> None:
    text = (REPO_ROOT / "docs" / "shared-memory.md").read_text()
    for switch in ("KVSTORE_SHARED_MEMORY", "--no-shared-memory", "shared_memory=False"):
        assert switch in text, f"docs/shared-memory.md does not mention {switch}"
