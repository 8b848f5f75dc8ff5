"""The health probes of the Dockerfile, docker-compose and Kubernetes, run as written against real nodes.

Each probe command is read from its file and run, with the environment its
file sets, against a real ``kvstore serve`` that runs with the same settings:
plaintext, and with TLS and bearer tokens turned on the way
``docker-compose.tls.yml`` and ``deploy/kubernetes/secret.example.yaml`` turn
them on. The files' ``/etc/kvstore/tls`` is a temporary folder here, holding a
throw-away CA's files under the names the deploy files use.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Mapping

import pytest
import yaml

from kvstore.security import channel_credentials
from tests.support.kvnode import KVNode
from tests.support.redis import make_tls_files

from tests.support.deploy import COMPOSE_FILE, COMPOSE_TLS_FILE, DOCKERFILE, KUBERNETES_DIR, healthcheck_command, load_yaml_documents, \
    parse_dockerfile

pytestmark = [pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed"),
              pytest.mark.slow]  # starts nodes: outside `make test-fast`

CONTAINER_TLS_DIR = "/etc/kvstore/tls"
PROBE_PORT = "127.0.0.1:50051"
TOKEN = "compose-demo-token-0123456789"
CLIENT_ENV_PREFIXES = ("KVSTORE_TLS", "KVSTORE_TOKEN")


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The deploy files' /etc/kvstore/tls: ca.crt, tls.crt and tls.key for DNS:kvstore, tokens.yaml, demo.token."""
    files = make_tls_files(tmp_path_factory.mktemp("ca"), subject_alt_names=("DNS:kvstore",))
    folder = tmp_path_factory.mktemp("tls")
    shutil.copy(files.ca_cert, folder / "ca.crt")
    shutil.copy(files.server_cert, folder / "tls.crt")
    shutil.copy(files.server_key, folder / "tls.key")
    (folder / "tokens.yaml").write_text(yaml.safe_dump({"tokens": [{"name": "demo", "token": TOKEN,
                                                                    "tenants": ["demo"]}]}))
    (folder / "demo.token").write_text(TOKEN + "\n")
    return folder


def _here(env: Mapping[str, object], tls_dir: Path) -> dict[str, str]:
    """``env`` with the container's TLS folder replaced by ``tls_dir``."""
    return {k: str(v).replace(CONTAINER_TLS_DIR, str(tls_dir)) for k, v in env.items()}


def _server_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("KVSTORE_SECURITY__")}


def _probe(command: list[str], env: Mapping[str, str], node: KVNode) -> subprocess.CompletedProcess[str]:
    """Run a probe's argv (``kvstore ...``) with ``env`` against ``node``, outside the repository."""
    assert command[0] == "kvstore"
    argv = [node.target if arg == PROBE_PORT else arg for arg in command[1:]]
    assert node.target in argv, f"the probe does not dial {PROBE_PORT}: {command}"
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(CLIENT_ENV_PREFIXES)} | dict(env)
    child_env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *argv], capture_output=True, text=True,
                          env=child_env, cwd="/", timeout=120)


@pytest.fixture(scope="module")
def plain_node() -> Iterator[KVNode]:
    with KVNode(memory_capacity="16MiB", metrics=False) as node:
        yield node


def _tls_node(env: Mapping[str, str], tls_dir: Path) -> KVNode:
    credentials = channel_credentials(tls_dir / "ca.crt")
    return KVNode(memory_capacity="16MiB", metrics=False, env=_server_env(env),
                  client_kwargs={"credentials": credentials,
                                 "channel_options": [("grpc.ssl_target_name_override", "kvstore")]})


def _compose_tls_env(tls_dir: Path) -> dict[str, str]:
    return _here(yaml.safe_load(COMPOSE_TLS_FILE.read_text())["services"]["kvstore"]["environment"], tls_dir)


def _k8s_tls_env(tls_dir: Path) -> dict[str, str]:
    templates = {(d["kind"], d["metadata"]["name"]): d
                 for d in load_yaml_documents(KUBERNETES_DIR / "secret.example.yaml")}
    return _here(templates[("ConfigMap", "kvstore-tls-env")]["data"], tls_dir)


def _k8s_probes() -> dict[str, list[str]]:
    statefulset = next(d for d in load_yaml_documents(KUBERNETES_DIR / "statefulset.yaml")
                       if d["kind"] == "StatefulSet")
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    return {name: container[name]["exec"]["command"] for name in ("startupProbe", "readinessProbe", "livenessProbe")}


def _dockerfile_probe(port: str) -> list[str]:
    """The HEALTHCHECK's shell command as argv, ``${KVSTORE_PORT:-50051}`` expanded as the image's shell would."""
    command = healthcheck_command(parse_dockerfile(DOCKERFILE)).split("||")[0]
    return command.replace('"127.0.0.1:${KVSTORE_PORT:-50051}"', PROBE_PORT).split()


# -- plaintext --------------------------------------------------------------------------------


def test_every_probe_passes_on_a_plaintext_node(plain_node: KVNode) -> None:
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    probes = {"Dockerfile": _dockerfile_probe(PROBE_PORT),
              "compose": compose["services"]["kvstore"]["healthcheck"]["test"][1:], **_k8s_probes()}
    for name, command in probes.items():
        result = _probe(command, {}, plain_node)
        assert result.returncode == 0 and result.stdout.strip() == "SERVING", (name, result.stderr)


# -- TLS and tokens --------------------------------------------------------------------------------


def test_the_compose_probe_passes_with_docker_compose_tls_yml(tls_dir: Path) -> None:
    env = _compose_tls_env(tls_dir)
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    with _tls_node(env, tls_dir) as node:
        command = compose["services"]["kvstore"]["healthcheck"]["test"][1:]
        result = _probe(command, env, node)
        assert result.returncode == 0 and result.stdout.strip() == "SERVING", result.stderr
        assert _probe(command, {}, node).returncode == 1  # the negative control: plaintext cannot talk to it
        docker = _probe(_dockerfile_probe(PROBE_PORT), env, node)  # the image's HEALTHCHECK, same environment
        assert docker.returncode == 0, docker.stderr


def test_the_compose_demo_worker_reaches_a_tls_node_with_its_token(tls_dir: Path) -> None:
    env = _compose_tls_env(tls_dir)
    demo = _here(yaml.safe_load(COMPOSE_TLS_FILE.read_text())["services"]["demo"]["environment"], tls_dir)
    with _tls_node(env, tls_dir) as node:
        stats = _probe(["kvstore", "stats", "--target", PROBE_PORT, "--tls-server-name", "kvstore"], demo, node)
        assert stats.returncode == 0, stats.stderr  # the token of demo.token, the CA of ca.crt
        assert _probe(["kvstore", "stats", "--target", PROBE_PORT, "--tls-server-name", "kvstore"],
                      {k: v for k, v in demo.items() if k != "KVSTORE_TOKEN_FILE"}, node).returncode == 1


def test_the_kubernetes_probes_pass_with_kvstore_tls_env(tls_dir: Path) -> None:
    env = _k8s_tls_env(tls_dir)
    with _tls_node(env, tls_dir) as node:
        for name, command in _k8s_probes().items():
            result = _probe(command, env, node)
            assert result.returncode == 0 and result.stdout.strip() == "SERVING", (name, result.stderr)


VLLM_TOKEN = "compose-vllm-token-0123456789"


@pytest.fixture(scope="module")
def vllm_tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """/etc/kvstore/tls as docs/security.md makes it: a certificate that names kvstore (and 127.0.0.1, which the
    tests dial), tokens.yaml with the demo's token and the vLLM workers' (every tenant), and both token files."""
    files = make_tls_files(tmp_path_factory.mktemp("ca"), subject_alt_names=("DNS:kvstore", "IP:127.0.0.1"))
    folder = tmp_path_factory.mktemp("tls")
    shutil.copy(files.ca_cert, folder / "ca.crt")
    shutil.copy(files.server_cert, folder / "tls.crt")
    shutil.copy(files.server_key, folder / "tls.key")
    (folder / "tokens.yaml").write_text(yaml.safe_dump({"tokens": [
        {"name": "demo", "token": TOKEN, "tenants": ["demo"]}, {"name": "vllm", "token": VLLM_TOKEN, "tenants": ["*"]}]}))
    (folder / "demo.token").write_text(TOKEN + "\n")
    (folder / "vllm.token").write_text(VLLM_TOKEN + "\n")
    return folder


def test_the_compose_vllm_workers_reach_a_tls_node_with_their_token(vllm_tls_dir: Path) -> None:
    """docker-compose.tls.yml gives the vLLM workers' connector the CA, its token and SHA-256 keys: with them it
    reads and writes a TLS node that requires tokens; without the token it is refused."""
    import json

    from kvstore.connectors.vllm.config import parse_config
    from kvstore.connectors.kit.stores import open_client
    from kvstore.errors import KVStoreError
    from kvstore.keys import Namespace, hash_blocks

    services = yaml.safe_load(COMPOSE_TLS_FILE.read_text())["services"]
    with _tls_node(_compose_tls_env(vllm_tls_dir), vllm_tls_dir) as node:
        for name in ("vllm", "vllm-gpu"):
            args = services[name]["command"]
            extra = json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
            extra = _here(extra, vllm_tls_dir)
            settings = parse_config(extra, environ={"KVSTORE_TARGET": node.target})  # compose's: kvstore:50051
            ns = Namespace(model=f"tls-{name}", dtype="float16", block_size=16, cache_salt="a-user",
                           hash_algorithm=settings.hash_algorithm)
            hashes = hash_blocks(ns, list(range(32)))
            with open_client(settings) as client:
                assert client.lookup(ns, hashes).num_blocks == 0  # TLS verified, the token accepted, SHA-256 keys
            anonymous = parse_config({k: v for k, v in extra.items() if k != "token_file"},
                                     environ={"KVSTORE_TARGET": node.target})
            with open_client(anonymous) as client, pytest.raises(KVStoreError):
                client.lookup(ns, hashes)
