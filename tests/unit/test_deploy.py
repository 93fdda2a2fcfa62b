"""deploy/: the image, compose and Kubernetes files, checked offline for what a build or
a cluster would reject or get wrong: the Kubernetes schemas (kubernetes-validate), the
names objects use to refer to each other, and the server's flags and TOML config through
the server's own parser and loader. No docker, no cluster; loopback only."""

from __future__ import annotations

import copy
import json
import re
import shlex
import tomllib
from concurrent import futures
from pathlib import Path

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from certs import self_signed
from expstore_server import healthcheck
from expstore_server.main import build_config, build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
K8S_VERSIONS = ("1.30", "1.37")  # an older cluster and the newest schemas kubernetes-validate ships
SECRET_PLACEHOLDER = "REPLACE-ME"


def server_config(argv: list[str], config_text: str | None, tmp_path: Path):
    """The ServerConfig a server started with ``argv`` would run with; the file ``--config``
    names inside the container is read from ``config_text``. Unknown flags fail here."""
    args = build_parser().parse_args(argv)
    if config_text is not None:
        assert args.config, f"no --config in {argv}"
        args.config = str(tmp_path / "expstore.toml")
        Path(args.config).write_text(config_text)
    return build_config(args)


def gibibytes(quantity: str) -> float:
    """A Kubernetes quantity (Gi or Mi) in GiB."""
    units = {"Gi": 1 << 30, "Mi": 1 << 20}
    number, unit = re.fullmatch(r"(\d+)(Gi|Mi)", quantity).groups()
    return int(number) * units[unit] / (1 << 30)


# -- the Dockerfile --------------------------------------------------------------------------

def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs, continuation lines joined, comments dropped."""
    lines = [line for line in (DEPLOY / "Dockerfile").read_text().splitlines()
             if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(word.upper(), rest.strip()) for word, _, rest in
            (line.strip().partition(" ") for line in text.splitlines() if line.strip())]


def instructions(name: str) -> list[str]:
    return [rest for instruction, rest in dockerfile() if instruction == name]


def entrypoint() -> list[str]:
    (value,) = instructions("ENTRYPOINT")
    return json.loads(value)


def test_dockerfile_entrypoint_runs_the_server_on_all_interfaces(tmp_path):
    command, *flags = entrypoint()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts[command] == "expstore_server.main:main"
    cfg = server_config(flags, None, tmp_path)
    assert cfg.host == "0.0.0.0"
    assert instructions("VOLUME") == [cfg.data_dir]
    exposed = {int(port) for value in instructions("EXPOSE") for port in value.split()}
    assert exposed == {cfg.port, cfg.resolved_flight_port, cfg.metrics_port} and cfg.metrics_port


def test_dockerfile_runs_as_non_root_from_python_slim():
    assert instructions("FROM")[-1] == "python:3.11-slim"
    (user,) = instructions("USER")
    assert user.split(":")[0] not in ("root", "0")
    (install,) = [r for r in instructions("RUN") if "pip install" in r]
    assert re.search(r'"\.\[(.*)\]"', install)[1] == "s3"  # the S3 tier; no [rl] (torch), no [dev]
    assert "./client" in install.split()  # expstore-client comes from the context, not a package index


def test_dockerfile_healthcheck_is_the_installed_health_client():
    (check,) = instructions("HEALTHCHECK")
    command = json.loads(check.split(" CMD ", 1)[1])
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts[command[0]] == "expstore_server.healthcheck:main"  # installed with the package
    assert "/opt/venv/bin" in " ".join(instructions("ENV"))  # on PATH
    healthcheck.build_parser().parse_args(command[1:])


def test_build_context_holds_what_the_dockerfile_copies():
    ignore = [line for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line and not line.startswith("#")]
    assert ignore[0] == "*"  # an allowlist: .git, .venv, runs/, expstore-data/ stay out
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for rest in instructions("COPY"):
        words = shlex.split(rest)
        if any(w.startswith("--from=") for w in words):
            continue  # from a build stage, not the context
        for source in [w for w in words if not w.startswith("--")][:-1]:
            assert (ROOT / source).exists(), source
            assert source.rstrip("/") in allowed, f"{source}: left out of the context by .dockerignore"


# -- the health check client (image HEALTHCHECK, TLS probes) --------------------------------


@pytest.fixture
def health_server():
    """A gRPC server on loopback with only the standard health service, as expstore serves it."""
    started = []

    def start(credentials=None):
        server = grpc.server(futures.ThreadPoolExecutor(2))
        servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_secure_port("127.0.0.1:0", credentials) if credentials else \
            server.add_insecure_port("127.0.0.1:0")
        server.start()
        started.append(server)
        return servicer, f"127.0.0.1:{port}", server

    yield start
    for server in started:
        server.stop(None)


def test_healthcheck_follows_the_serving_status(health_server):
    check = healthcheck.main
    servicer, address, server = health_server()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert check(["--address", address]) == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # a draining server
    assert check(["--address", address]) == 1
    server.stop(None)
    assert check(["--address", address, "--timeout", "1"]) == 1


def test_healthcheck_over_tls_checks_the_certificate_name(health_server, tmp_path):
    check = healthcheck.main
    cert, key = self_signed(tmp_path, "expstore", ips=())  # not 127.0.0.1
    servicer, address, _ = health_server(grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())]))
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert check(["--address", address, "--tls-ca", str(cert), "--server-name", "expstore"]) == 0
    assert check(["--address", address, "--tls-ca", str(cert), "--timeout", "1"]) == 1  # 127.0.0.1 is not named
    assert check(["--address", address, "--timeout", "1"]) == 1  # plaintext to a TLS-only server


# -- compose ----------------------------------------------------------------------------------

def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def mounted_files(service: dict) -> dict[str, Path]:
    """Container path -> file in deploy/ for each bind mount of a local file."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            mounts[target] = (DEPLOY / source).resolve()
    return mounts


def compose_server(tmp_path: Path):
    services = compose()["services"]
    server = services["expstore"]
    config_path = build_parser().parse_args(server["command"]).config
    config_text = mounted_files(server)[config_path].read_text()
    return services, server, server_config(entrypoint()[1:] + server["command"], config_text, tmp_path)


def test_compose_builds_the_image_and_mounts_files_that_exist():
    services = compose()["services"]
    build = services["expstore"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    for name, service in services.items():
        for target, path in mounted_files(service).items():
            assert path.is_file(), f"{name}: {path} (mounted at {target})"
        assert set(service.get("depends_on", ())) <= set(services)


def test_compose_server_config_points_at_the_object_store(tmp_path):
    services, server, cfg = compose_server(tmp_path)
    bucket = re.fullmatch(r"s3://([^/]+)/.+", cfg.remote.uri)[1]
    assert services["createbucket"]["command"][-1].endswith(f"/{bucket}")  # mc mb ALIAS/BUCKET
    endpoint_host = re.fullmatch(r"http://([^:/]+):\d+", cfg.remote.endpoint)[1]
    store = services[endpoint_host]
    assert store["environment"]["MINIO_ROOT_USER"] == cfg.remote.access_key_id
    assert server["environment"][cfg.remote.secret_access_key_env] == store["environment"]["MINIO_ROOT_PASSWORD"]
    assert "createbucket" in server["depends_on"]
    assert int(server["stop_grace_period"].removesuffix("s")) > cfg.grace_s


def test_prometheus_scrapes_the_server_metrics_port(tmp_path):
    services, _, cfg = compose_server(tmp_path)
    prometheus = services["prometheus"]
    mounts = mounted_files(prometheus)
    scrape = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    targets = [t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    assert targets == [f"expstore:{cfg.metrics_port}"]


# -- Kubernetes -------------------------------------------------------------------------------

def load_yaml_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kustomization(directory: Path) -> dict:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def k8s_objects(directory: Path = K8S) -> dict[tuple[str, str], dict]:
    """(kind, name) -> object, for every resource the kustomization lists."""
    objects = {}
    for resource in kustomization(directory)["resources"]:
        for doc in load_yaml_documents(directory / resource):
            objects[doc["kind"], doc["metadata"]["name"]] = doc
    return objects


def json_patch(doc: dict, ops: list[dict]) -> dict:
    """Apply RFC 6902 add/replace operations (what the TLS component uses)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        target = doc
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if isinstance(target, list):
            assert op["op"] == "add" and last == "-", op
            target.append(op["value"])
        else:
            assert op["op"] == "add" or last in target, f"replace of a missing {op['path']}"
            target[last] = op["value"]
    return doc


def tls_objects() -> dict[tuple[str, str], dict]:
    """The base objects with the TLS component applied."""
    component = kustomization(K8S / "tls")
    assert component["kind"] == "Component"
    objects = k8s_objects() | k8s_objects(K8S / "tls")
    for patch in component["patches"]:
        key = (patch["target"]["kind"], patch["target"]["name"])
        objects[key] = json_patch(objects[key], yaml.safe_load((K8S / "tls" / patch["path"]).read_text()))
    return objects


def pod_env(container: dict, objects: dict, pod_name: str) -> dict[str, str]:
    """The container's environment as the kubelet would set it (Secret values resolved)."""
    env = {}
    for var in container.get("env", []):
        source = var.get("valueFrom", {})
        if "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "metadata.name"
            env[var["name"]] = pod_name
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            secret = objects.get(("Secret", ref["name"]))
            assert secret is not None, f"env {var['name']}: no Secret {ref['name']}"
            assert ref["key"] in secret["stringData"], f"env {var['name']}: Secret {ref['name']} has no {ref['key']}"
            env[var["name"]] = secret["stringData"][ref["key"]]
        else:
            env[var["name"]] = var["value"]
    return env


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args; an undefined VAR would stay as it is, silently."""
    def value(m: re.Match) -> str:
        assert m[1] in env, f"{arg}: $({m[1]}) is not in the container's env"
        return env[m[1]]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value, arg)


def statefulset(objects: dict) -> tuple[dict, dict]:
    (sts,) = [o for (kind, _), o in objects.items() if kind == "StatefulSet"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return sts, container


def mounted_file(path: str, container: dict, pod: dict, objects: dict) -> tuple[dict, str]:
    """The ConfigMap or Secret (and its key) that provides file ``path`` in the container."""
    (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    filename = path[len(mount["mountPath"].rstrip("/")) + 1:]
    if "configMap" in volume:
        source = objects[("ConfigMap", volume["configMap"]["name"])]
        key = {i["path"]: i["key"] for i in volume["configMap"].get("items", [])}.get(filename, filename)
        assert key in source["data"], f"{path}: ConfigMap has no key {key}"
    else:
        source = objects[("Secret", volume["secret"]["secretName"])]
        key = filename
        assert key in source["stringData"], f"{path}: Secret has no key {key}"
    return source, key


def k8s_server(objects: dict, tmp_path: Path, pod_name: str = "expstore-0"):
    """What the server of pod ``pod_name`` runs with: (config, env)."""
    sts, container = statefulset(objects)
    pod = sts["spec"]["template"]["spec"]
    env = pod_env(container, objects, pod_name)
    argv = entrypoint()[1:] + [expand(a, env) for a in container["args"]]
    config_path = build_parser().parse_args(argv).config
    source, key = mounted_file(config_path, container, pod, objects)
    return server_config(argv, source["data"][key], tmp_path), env


def test_kustomization_lists_every_manifest():
    listed = set(kustomization(K8S)["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    component = kustomization(K8S / "tls")
    files = set(component["resources"]) | {p["path"] for p in component["patches"]}
    assert files == {p.name for p in (K8S / "tls").glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("variant", ["base", "tls"])
def test_manifests_match_the_kubernetes_schemas(version, variant):
    objects = k8s_objects() if variant == "base" else tls_objects()
    assert {kind for kind, _ in objects} == {"ConfigMap", "Secret", "Service", "StatefulSet", "PodDisruptionBudget"}
    for (kind, name), obj in objects.items():
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{kind}/{name} against {version}: {'.'.join(map(str, e.path))}: {e.message}")


@pytest.mark.parametrize("variant", ["base", "tls"])
def test_statefulset_refers_to_objects_that_exist(variant):
    objects = k8s_objects() if variant == "base" else tls_objects()
    sts, container = statefulset(objects)
    pod = sts["spec"]["template"]
    labels = pod["metadata"]["labels"]
    service = objects[("Service", sts["spec"]["serviceName"])]
    assert service["spec"]["clusterIP"] == "None"  # headless: expstore-<i>.expstore names
    assert service["spec"]["publishNotReadyAddresses"] is True
    for selector in (sts["spec"]["selector"]["matchLabels"], service["spec"]["selector"],
                     objects[("PodDisruptionBudget", "expstore")]["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
    assert {m["name"] for m in container["volumeMounts"]} <= set(volumes) | claims
    for volume in volumes.values():
        if "configMap" in volume:
            config_map = objects[("ConfigMap", volume["configMap"]["name"])]
            assert {i["key"] for i in volume["configMap"]["items"]} <= set(config_map["data"])
        if "secret" in volume:
            assert ("Secret", volume["secret"]["secretName"]) in objects
    pod_env(container, objects, "expstore-0")  # every secretKeyRef resolves
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= {p["name"] for p in container["ports"]}


def test_statefulset_runs_the_server_with_its_config(tmp_path, monkeypatch):
    objects = k8s_objects()
    sts, container = statefulset(objects)
    cfg, env = k8s_server(objects, tmp_path)
    assert cfg.host == "0.0.0.0"
    (data_mount,) = [m for m in container["volumeMounts"] if m["name"] == "data"]
    assert cfg.data_dir == data_mount["mountPath"]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cfg.tokens and all(token.secret() for token in cfg.tokens)  # each token_env is set
    assert cfg.remote.secret() and "AWS_ACCESS_KEY_ID" in env
    # Each shard its own remote prefix: chunks and checkpoints of one table name never mix.
    other, _ = k8s_server(objects, tmp_path, "expstore-1")
    assert cfg.remote.uri.startswith("s3://") and cfg.remote.uri != other.remote.uri
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= cfg.grace_s + 15


def test_probes_ask_the_grpc_health_service_on_the_grpc_port(tmp_path):
    objects = k8s_objects()
    _, container = statefulset(objects)
    cfg, _ = k8s_server(objects, tmp_path)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": cfg.port, "flight": cfg.resolved_flight_port, "metrics": cfg.metrics_port}
    service = objects[("Service", "expstore")]  # clients reach the gRPC and the Flight port (GetServerInfo)
    assert {p["port"] for p in service["spec"]["ports"]} == {cfg.port, cfg.resolved_flight_port, cfg.metrics_port}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == cfg.port, probe


def test_tls_component_serves_tls_and_probes_over_it(tmp_path):
    objects = tls_objects()
    sts, container = statefulset(objects)
    pod = sts["spec"]["template"]["spec"]
    cfg, _ = k8s_server(objects, tmp_path)
    for path in (cfg.tls_cert, cfg.tls_key):
        source, _ = mounted_file(path, container, pod, objects)
        assert source["type"] == "kubernetes.io/tls"
    parser = healthcheck.build_parser()
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert "grpc" not in container[probe], f"{probe}: the kubelet's grpc probes speak plaintext only"
        command, *flags = container[probe]["exec"]["command"]
        check = parser.parse_args(flags)
        assert command == "expstore-healthcheck" and check.server_name
        assert check.address.endswith(f":{cfg.port}")
        mounted_file(check.tls_ca, container, pod, objects)


def test_pod_runs_non_root_within_its_resources(tmp_path):
    objects = k8s_objects()
    sts, container = statefulset(objects)
    pod = sts["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    cfg, _ = k8s_server(objects, tmp_path)
    cache = sum(t.memory_bytes for t in cfg.tables) / (1 << 30)
    limit = gibibytes(container["resources"]["limits"]["memory"])
    assert gibibytes(container["resources"]["requests"]["memory"]) == limit  # no overcommit of a cache
    # deploy/README.md, "Sizing": 0.5 GB + the caches + 0.75 GB per million items (+ 0.3 GB with S3)
    assert limit >= 0.5 + cache + 0.75 * sum(t.max_size for t in cfg.tables) / 1e6 + 0.3
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    disk = gibibytes(claim["spec"]["resources"]["requests"]["storage"])
    ssd = sum(t.ssd_bytes for t in cfg.tables) / (1 << 30)
    assert disk >= ssd * 1.3 + cfg.min_free_disk_bytes / (1 << 30)  # RocksDB compaction headroom


def test_secrets_hold_placeholders_only():
    secrets = [o for (kind, _), o in tls_objects().items() if kind == "Secret"]
    assert len(secrets) == 2
    for secret in secrets:
        for key, value in secret["stringData"].items():
            assert value.startswith(SECRET_PLACEHOLDER), f"{secret['metadata']['name']}.{key}"
