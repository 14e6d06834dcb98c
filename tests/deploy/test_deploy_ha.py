"""High availability: deploy/compose.ha.yml and deploy/kubernetes-ha, and their replicas on a real PostgreSQL."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator

import kubernetes_validate
import pytest
import yaml
from _deploy import (
    BIN,
    COMPOSE,
    COMPOSE_HA,
    DATABASE_SECRET,
    HA,
    HA_NOT_APPLIED,
    KUBE,
    KUBE_VERSIONS,
    PROBES,
    REPLICAS,
    ROOT,
    Replica,
    build_dockerfile,
    built,
    compose,
    compose_ha,
    container_env,
    dry_run,
    env_of,
    health,
    interpolate,
    kube,
    kube_docs,
    kubectl_create_secret_commands,
    kustomize,
    mounts,
    option,
    pod_container,
    read_image,
    replace_option,
    requirement_names,
    serve_args,
    service_argv,
    store_url,
    without_option,
)
from grpc_health.v1 import health_pb2

pytest_plugins = ["_postgres"]  # a real PostgreSQL for the replicas of deploy/kubernetes-ha


def test_compose_ha_follows_the_compose_spec() -> None:
    r = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(COMPOSE_HA)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_compose_ha_runs_three_replicas_on_one_database(monkeypatch: pytest.MonkeyPatch) -> None:
    c, base = compose_ha(), compose()["services"]
    services = c["services"]
    assert set(services) == {"postgres", *REPLICAS, "trainer-head", "trainer", "audit"}
    assert set(c["volumes"]) == {"postgres-data", "work"}

    # The database: its data on a volume, healthy once it accepts connections over TCP, not published.
    pg = services["postgres"]
    assert pg["image"] == "postgres:15" and mounts(pg) == {"postgres-data": "/var/lib/postgresql/data"}
    assert "ports" not in pg, "only the replicas reach the database"
    check = pg["healthcheck"]["test"]
    assert check[:2] == ["CMD", "pg_isready"]
    pg_env = {k: interpolate(v) for k, v in pg["environment"].items()}
    assert option(check, "-U") == pg_env["POSTGRES_USER"] and option(check, "-d") == pg_env["POSTGRES_DB"]
    assert option(check, "-h") == "127.0.0.1", "over TCP: the image's initializing server listens on its socket only"

    # Three replicas of docker-compose.yml's coordinator, without --store: CROUPIER_STORE names the database.
    coord = base["coordinator"]
    published = set()
    urls = set()
    for name in REPLICAS:
        s = services[name]
        assert s["image"] == coord["image"] and build_dockerfile(s, COMPOSE_HA) == build_dockerfile(coord)
        assert (COMPOSE_HA.parent / s["build"]["context"]).resolve() == (COMPOSE.parent / coord["build"]["context"]).resolve()
        argv = service_argv(s, COMPOSE_HA)
        assert argv == without_option(service_argv(coord), "--store"), "the base's command; the password stays out of it"
        assert s["healthcheck"] == coord["healthcheck"]
        assert s["depends_on"] == {"postgres": {"condition": "service_healthy"}}
        url = interpolate(s["environment"]["CROUPIER_STORE"])
        assert serve_args(argv, {"CROUPIER_STORE": url}, monkeypatch).store == url, "croupier serve reads CROUPIER_STORE"
        urls.add(url)
        ((host_port, container_port),) = [p.rsplit(":", 2)[1:] for p in s["ports"]]
        assert container_port == option(argv, "--port")
        published.add(host_port)
    assert len(published) == len(REPLICAS), "one host port each"

    # One store, the postgres service's database, with its user and password (also when the password is set).
    (url,) = urls
    u = store_url(url)
    assert (u.hostname, u.port, u.username, u.password, u.path) == (
        "postgres", 5432, pg_env["POSTGRES_USER"], pg_env["POSTGRES_PASSWORD"], "/" + pg_env["POSTGRES_DB"])
    chosen = {"CROUPIER_PG_PASSWORD": "s3cret"}
    assert {store_url(interpolate(services[n]["environment"]["CROUPIER_STORE"], chosen)).password for n in REPLICAS} == {
        interpolate(pg["environment"]["POSTGRES_PASSWORD"], chosen)} == {"s3cret"}

    # The trainers and the audit of docker-compose.yml; the trainers dial every replica.
    port = option(service_argv(coord), "--port")
    for name in ("trainer-head", "trainer", "audit"):
        s, b = services[name], base[name]
        assert service_argv(s, COMPOSE_HA) == service_argv(b) and mounts(s) == mounts(b)
        assert build_dockerfile(s, COMPOSE_HA) == build_dockerfile(b)
        assert {k: v for k, v in s.items() if k not in ("build", "environment", "depends_on")} == \
            {k: v for k, v in b.items() if k not in ("build", "environment", "depends_on")}
    for name in ("trainer-head", "trainer"):
        env, b_env = services[name]["environment"], base[name]["environment"]
        assert env["CROUPIER_ADDRESS"] == ",".join(f"{r}:{port}" for r in REPLICAS)
        assert {k: v for k, v in env.items() if k != "CROUPIER_ADDRESS"} == {k: v for k, v in b_env.items() if k != "CROUPIER_ADDRESS"}
        depends = services[name]["depends_on"]
        assert all(depends[r] == {"condition": "service_healthy"} for r in REPLICAS)
        assert {k: v for k, v in depends.items() if k not in REPLICAS} == \
            {k: v for k, v in base[name]["depends_on"].items() if k != "coordinator"}
    assert services["audit"]["depends_on"] == base["audit"]["depends_on"]


def test_coordinator_image_installs_what_the_postgresql_store_imports() -> None:
    """Every third-party module server/_pg_store.py imports comes from pyproject's dependencies or the image's pip installs."""
    tree = ast.parse((ROOT / "server" / "_pg_store.py").read_text())
    modules = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module.split(".")[0] for node in tree.body
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    third_party = modules - set(sys.stdlib_module_names) - {"croupier"}
    assert {"psycopg", "psycopg_pool"} <= third_party

    pyproject = (ROOT / "pyproject.toml").read_text()
    deps = pyproject.split("\ndependencies = [", 1)[1].split("\n]", 1)[0]
    declared = requirement_names([d for d in re.findall(r'"([^"]+)"', deps)])
    image = read_image(ROOT / "deploy" / "docker" / "coordinator.Dockerfile")
    for run in image.runs:
        words = shlex.split(run.split("&&")[0])
        if words[:2] == ["pip", "install"]:
            declared |= requirement_names([w for w in words[2:] if not w.startswith("-") and w != "."
                                           and w != "constraints.txt" and not w.startswith("$")])
    distributions = importlib.metadata.packages_distributions()
    for module in sorted(third_party):
        assert requirement_names(distributions[module]) & declared, f"the coordinator image does not install {module}"
    assert any("import croupier.server._pg_store" in r for r in image.runs), "the build imports the store"


def test_ha_kustomization_holds_the_replicas_services_and_budget() -> None:
    spec = yaml.safe_load((HA / "kustomization.yaml").read_text())
    resources = {HA / r for r in spec["resources"]}
    assert all(r.is_file() for r in resources)
    assert set(HA.glob("*.yaml")) == resources | {HA / "kustomization.yaml", *(HA / n for n in HA_NOT_APPLIED)}
    assert spec["images"] == yaml.safe_load((KUBE / "kustomization.yaml").read_text())["images"]
    docs = kustomize(HA)
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == [
        ("Deployment", "croupier"), ("PodDisruptionBudget", "croupier"), ("Service", "croupier"), ("Service", "croupier-headless")]
    # What it does not apply validates all the same.
    for name in HA_NOT_APPLIED:
        for doc in kube_docs(HA / name):
            for version in KUBE_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)


def test_ha_deployment_takes_its_store_from_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    dep, base = built(HA, "Deployment", "croupier"), kube("StatefulSet", "croupier")
    c, base_c = pod_container(dep), pod_container(base)
    pod, base_pod = dep["spec"]["template"]["spec"], base["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 3
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0, "a rollout starts a successor first"

    argv = c["command"] + c["args"]
    assert argv == without_option(base_c["command"] + base_c["args"], "--store")
    ref = {"secretKeyRef": {"name": DATABASE_SECRET[0], "key": DATABASE_SECRET[1]}}
    assert c["env"] == [{"name": "CROUPIER_STORE", "valueFrom": ref}]
    assert not any("://" in str(v) for v in argv + [e.get("value", "") for e in c["env"]]), "no store URL in the pod spec"
    (example,) = kube_docs(HA / "secrets.example.yaml")
    assert (example["kind"], example["metadata"]["name"], set(example["stringData"])) == ("Secret", DATABASE_SECRET[0], {DATABASE_SECRET[1]})
    url = example["stringData"][DATABASE_SECRET[1]]
    store_url(url)
    assert serve_args(argv, container_env(c, {DATABASE_SECRET: url.encode()}), monkeypatch).store == url

    # No state of its own: no volume but /tmp, and no claims.
    assert "volumeClaimTemplates" not in dep["spec"]
    assert all(set(v) == {"name", "emptyDir"} for v in pod["volumes"])
    assert [m["mountPath"] for m in c["volumeMounts"]] == ["/tmp"]
    # The base's probes, ports, resources and security settings.
    port = int(option(argv, "--port"))
    assert c["ports"] == base_c["ports"] and [p["containerPort"] for p in c["ports"]] == [port]
    for probe in PROBES:
        assert c[probe] == base_c[probe] and c[probe]["grpc"]["port"] == port
    assert c["resources"] == base_c["resources"] and c["securityContext"] == base_c["securityContext"]
    assert pod["securityContext"] == base_pod["securityContext"]
    for key in ("terminationGracePeriodSeconds", "automountServiceAccountToken", "enableServiceLinks"):
        assert pod[key] == base_pod[key], key
    # Replicas on different nodes where the scheduler can.
    labels = dep["spec"]["template"]["metadata"]["labels"]
    (term,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"] == {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": labels}}


def test_ha_services_and_budget_select_the_replicas() -> None:
    dep = built(HA, "Deployment", "croupier")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"] == labels

    pdb = built(HA, "PodDisruptionBudget", "croupier")["spec"]
    assert pdb["selector"]["matchLabels"] == labels
    down = pdb["maxUnavailable"] if "maxUnavailable" in pdb else dep["spec"]["replicas"] - pdb["minAvailable"]
    assert down == 1, "a drain takes one replica at a time, and can take one"

    service, headless = built(HA, "Service", "croupier"), built(HA, "Service", "croupier-headless")
    assert service["spec"]["type"] == "ClusterIP" and "clusterIP" not in service["spec"]
    assert headless["spec"]["clusterIP"] == "None"
    assert not headless["spec"].get("publishNotReadyAddresses", False), "DNS names only the ready replicas"
    port = dep["spec"]["template"]["spec"]["containers"][0]["ports"][0]
    for s in (service, headless):
        assert s["spec"]["selector"].items() <= labels.items()
        assert [(p["port"], p["targetPort"]) for p in s["spec"]["ports"]] == [(port["containerPort"], port["name"])]
        assert s["spec"]["ports"] == kube("Service", s["metadata"]["name"])["spec"]["ports"], "the base's name and port"
    # So the demo job, a client of the base, reaches the replicas unchanged; the dev database is none of them.
    assert env_of(pod_container(kube("Job", "croupier-demo")))["CROUPIER_ADDRESS"] == f"croupier:{port['containerPort']}"
    for doc in kube_docs(HA / "dev-postgres.yaml"):
        if "template" in doc["spec"]:
            assert not service["spec"]["selector"].items() <= doc["spec"]["template"]["metadata"]["labels"].items()


def test_ha_secret_commands_make_what_the_replicas_and_the_dev_database_read(tmp_path: pathlib.Path) -> None:
    """The `kubectl create secret` commands of secrets.example.yaml and dev-postgres.yaml, with --dry-run=client."""
    import base64

    def made(path: pathlib.Path) -> dict[str, dict[str, str]]:
        commands = kubectl_create_secret_commands(path)
        assert commands, path
        outs = [dry_run(command, tmp_path) for command in commands]
        return {o["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in o["data"].items()} for o in outs}

    (example,) = kube_docs(HA / "secrets.example.yaml")
    secrets = made(HA / "secrets.example.yaml")
    assert {n: set(d) for n, d in secrets.items()} == {example["metadata"]["name"]: set(example["stringData"])}
    store_url(secrets[DATABASE_SECRET[0]][DATABASE_SECRET[1]])

    # The dev database: its password from a Secret of its own, and the replicas' URL names its Service,
    # port, user, database and that password.
    docs = {d["kind"]: d for d in kube_docs(HA / "dev-postgres.yaml")}
    sts, service = docs["StatefulSet"], docs["Service"]
    c = pod_container(sts)
    env = {e["name"]: e for e in c["env"]}
    password_ref = env["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"]
    dev = made(HA / "dev-postgres.yaml")
    assert set(dev) == {password_ref["name"], DATABASE_SECRET[0]}
    u = store_url(dev[DATABASE_SECRET[0]][DATABASE_SECRET[1]])
    assert (u.hostname, u.port, u.username, u.password, u.path) == (
        service["metadata"]["name"], service["spec"]["ports"][0]["port"], env["POSTGRES_USER"]["value"],
        dev[password_ref["name"]][password_ref["key"]], "/" + env["POSTGRES_DB"]["value"])
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert [p["containerPort"] for p in c["ports"]] == [5432] and service["spec"]["ports"][0]["targetPort"] == c["ports"][0]["name"]


@pytest.fixture
def ha_replicas(postgres_url: str, tmp_path: pathlib.Path) -> Iterator[list[Replica]]:
    """The HA Deployment's command and environment, three times at once on one real PostgreSQL database: the
    Secret's url is `postgres_url`; only the port (0: a free one) and the interface (loopback) replaced."""
    c = pod_container(built(HA, "Deployment", "croupier"))
    argv = replace_option(replace_option(c["command"] + c["args"], "--port", "0"), "--host", "127.0.0.1")
    argv[0] = str(BIN / argv[0])
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CROUPIER_")}
    env = {**clean, **container_env(c, {DATABASE_SECRET: postgres_url.encode()})}
    started: list[tuple[subprocess.Popen[str], pathlib.Path]] = []
    try:
        for i in range(3):  # all started before any is waited for, as a Deployment starts them
            workdir = tmp_path / f"pod-{i}"
            workdir.mkdir()
            started.append((subprocess.Popen(argv, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             text=True), workdir))
        replicas = []
        for proc, workdir in started:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.startswith("listening on "):
                proc.kill()
                _, err = proc.communicate(timeout=10)
                raise AssertionError(f"croupier serve did not start: {line!r} {err}")
            replicas.append(Replica(proc, f"127.0.0.1:{line.rsplit(':', 1)[1].strip()}", workdir))
        yield replicas
    finally:
        for proc, _ in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@pytest.mark.e2e
def test_ha_replicas_serve_one_job_as_the_deployment_says(ha_replicas: list[Replica], monkeypatch: pytest.MonkeyPatch) -> None:
    from croupier.client._rpc import CoordinatorClient
    from croupier.core.api import JoinRequest
    from croupier.core.spec import Spec

    for k in [k for k in os.environ if k.startswith("CROUPIER_")]:
        monkeypatch.delenv(k)
    first, second, third = ha_replicas
    c = pod_container(built(HA, "Deployment", "croupier"))
    for r in ha_replicas:
        for probe in PROBES:
            assert health(r.address, c[probe]["grpc"].get("service", "")) == health_pb2.HealthCheckResponse.SERVING, probe
    # The compose replicas' health check, against one of them.
    check = compose_ha()["services"]["coordinator-2"]["healthcheck"]["test"][1:]
    code = check[-1].replace("127.0.0.1:50051", second.address)
    assert code != check[-1]
    r = subprocess.run([sys.executable, *check[1:-1], code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr

    # A job of one rank joins through the first replica; the third reads it from the database.
    spec = Spec(n=100, seed=0)
    with CoordinatorClient(first.address, retry_for=10.0) as client:
        joined = client.join(JoinRequest("ha", spec, "t1", 1, 0), wait_s=5.0)
    assert joined.start is not None
    with CoordinatorClient(third.address, retry_for=10.0) as client:
        status = client.status("ha")
    assert (status.spec, status.result.generation, status.result.world, status.result.start) == (
        spec, joined.generation, 1, joined.start)

    # The trainers' address list: with the first replica dead (kill -9), calls move on to the others.
    first.proc.kill()
    first.proc.wait(timeout=10)
    with CoordinatorClient(",".join(r.address for r in ha_replicas), retry_for=30.0) as client:
        assert client.status("ha").result.generation == joined.generation
        assert client.retries >= 1, "the first replica was tried, and found dead"
    for replica in (second, third):
        replica.proc.send_signal(signal.SIGTERM)
        assert replica.proc.wait(timeout=30) == 0
    for replica in ha_replicas:
        assert not any(replica.workdir.iterdir()), "a replica keeps nothing on its own disk"
