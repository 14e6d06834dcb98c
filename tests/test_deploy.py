"""The deploy files: compose, Kubernetes and Docker checked offline, and the commands they run, run for real."""

from __future__ import annotations

import ast
import copy
import dataclasses
import fnmatch
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterator
from typing import Any

import grpc
import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser
from grpc_health.v1 import health_pb2, health_pb2_grpc
from packaging.requirements import Requirement

pytest_plugins = ["_postgres"]  # a real PostgreSQL for the replicas of deploy/kubernetes-ha

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
KUBE = ROOT / "deploy" / "kubernetes"
BIN = pathlib.Path(sys.executable).parent
TRAINER_MODULE = "croupier.tools.demo_train"
#: The coordinator's health service answers for the server ("") and for its API.
HEALTH_SERVICES = ("", "croupier.v1.Coordinator")
#: The oldest Kubernetes the manifests are for (gRPC probes, PDB unhealthyPodEvictionPolicy), and the newest.
KUBE_VERSIONS = ("1.29", kubernetes_validate.utils.latest_version())


def _package_dirs() -> tuple[str, ...]:
    """The top-level folders of pyproject's package-dir (croupier.core = "core", ...): `pip install .` needs each."""
    line = next(ln for ln in (ROOT / "pyproject.toml").read_text().splitlines() if ln.startswith("package-dir"))
    return tuple(sorted({folder.split("/")[0] for folder in re.findall(r'= "([^"]+)"', line)}))


#: What the images COPY: the package (every folder of pyproject's package-dir) and what `pip install .` reads.
BUILD_CONTEXT = ("pyproject.toml", "README.md", "constraints.txt", *_package_dirs())


# --- reading the files ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Image:
    """What `docker run` gets from a Dockerfile: its final stage, and the sources every stage copies."""

    base: str
    user: str
    entrypoint: list[str]
    cmd: list[str]
    healthcheck: list[str] | None  # HEALTHCHECK's CMD; None for HEALTHCHECK NONE
    volumes: list[str]
    exposed: list[str]
    env: dict[str, str]
    copied: list[str]
    runs: list[str]


def exec_form(instruction: str, value: str) -> list[str]:
    try:
        form = json.loads(value)
    except ValueError:
        form = None
    if not (isinstance(form, list) and all(isinstance(s, str) for s in form)):
        raise AssertionError(f"{instruction} must be in exec form (a JSON array), so signals reach the process (got {value!r})")
    return form


def read_image(dockerfile: pathlib.Path) -> Image:
    with open(dockerfile, "rb") as f:
        parser = DockerfileParser(fileobj=f)
        structure, base, env = parser.structure, parser.baseimage, parser.envs
    last_from = max(i for i, ins in enumerate(structure) if ins["instruction"] == "FROM")
    final = structure[last_from:]

    def last(name: str) -> str | None:
        values = [ins["value"] for ins in final if ins["instruction"] == name]
        return values[-1] if values else None

    health = last("HEALTHCHECK")
    healthcheck = None
    if health is not None and health.strip() != "NONE":
        _, sep, cmd = health.partition("CMD ")
        assert sep, f"HEALTHCHECK must run a command (got {health!r})"
        healthcheck = exec_form("HEALTHCHECK CMD", cmd.strip())
    copied = [src for ins in structure if ins["instruction"] == "COPY" and "--from=" not in ins["value"]
              for src in shlex.split(ins["value"])[:-1]]
    volumes = [v for ins in final if ins["instruction"] == "VOLUME"
               for v in (json.loads(ins["value"]) if ins["value"].startswith("[") else ins["value"].split())]
    return Image(
        base=base, user=last("USER") or "root",
        entrypoint=exec_form("ENTRYPOINT", last("ENTRYPOINT") or "[]"), cmd=exec_form("CMD", last("CMD") or "[]"),
        healthcheck=healthcheck, volumes=volumes,
        exposed=[p for ins in final if ins["instruction"] == "EXPOSE" for p in ins["value"].split()],
        env=dict(env), copied=[c.rstrip("/") for c in copied],
        runs=[ins["value"] for ins in structure if ins["instruction"] == "RUN"],
    )


def compose() -> dict[str, Any]:
    with open(COMPOSE) as f:
        return yaml.safe_load(f)


def service_image(service: dict[str, Any], compose_file: pathlib.Path = COMPOSE) -> Image:
    return read_image(build_dockerfile(service, compose_file))


def build_dockerfile(service: dict[str, Any], compose_file: pathlib.Path = COMPOSE) -> pathlib.Path:
    """The Dockerfile a service builds: its context is relative to the compose file's folder."""
    build = service["build"]
    return (compose_file.parent / build["context"] / build["dockerfile"]).resolve()


def as_list(value: str | list[str]) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else list(value)


def service_argv(service: dict[str, Any], compose_file: pathlib.Path = COMPOSE) -> list[str]:
    """What the container runs: Docker's rule for entrypoint and command over the image's ENTRYPOINT and CMD."""
    image = service_image(service, compose_file)
    if "entrypoint" in service:  # a new entrypoint drops the image's CMD
        return as_list(service["entrypoint"]) + as_list(service.get("command", []))
    return image.entrypoint + as_list(service.get("command", image.cmd))


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Named volume -> path in the container."""
    out = {}
    for v in service.get("volumes", []):
        source, target = v.split(":")[:2] if isinstance(v, str) else (v["source"], v["target"])
        out[source] = target
    return out


def option(argv: list[str], name: str) -> str:
    """The value of `--name VALUE` or `--name=VALUE` in argv."""
    for i, arg in enumerate(argv):
        if arg == name:
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} not in {argv}")


def replace_option(argv: list[str], name: str, value: str) -> list[str]:
    out = list(argv)
    i = out.index(name)
    out[i + 1] = value
    return out


def without_option(argv: list[str], name: str) -> list[str]:
    """argv without `--name VALUE`."""
    i = argv.index(name)
    return argv[:i] + argv[i + 2:]


def kube_files() -> list[pathlib.Path]:
    return sorted(p for p in KUBE.rglob("*.yaml") if p.name != "kustomization.yaml")


def kube_docs(path: pathlib.Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def kube(kind: str, name: str) -> dict[str, Any]:
    found = [d for p in kube_files() for d in kube_docs(p) if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} manifests"
    return found[0]


def pod_container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def torchrun_args(argv: list[str]) -> Any:
    """torchrun's own parser over a torchrun command line: unknown or misspelt options fail here."""
    from torch.distributed.run import get_args_parser

    assert pathlib.Path(argv[0]).name == "torchrun", argv
    return get_args_parser().parse_args(argv[1:])


def health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)


# --- docker-compose.yml ---------------------------------------------------------------------------


def test_compose_file_follows_the_compose_spec(tmp_path: pathlib.Path) -> None:
    def check(path: pathlib.Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)],
                              capture_output=True, text=True, timeout=60)

    ok = check(COMPOSE)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # The same check refuses a misspelt key.
    broken = compose()
    broken["services"]["coordinator"]["healthcheck"]["intervall"] = "5s"
    (tmp_path / "docker-compose.yml").write_text(yaml.safe_dump(broken))
    assert check(tmp_path / "docker-compose.yml").returncode != 0


def test_compose_names_its_services_volumes_and_wiring() -> None:
    c = compose()
    services = c["services"]
    assert set(services) == {"coordinator", "trainer-head", "trainer", "audit"}
    assert set(c["volumes"]) == {"coordinator-data", "work"}

    coord = services["coordinator"]
    argv = service_argv(coord)
    assert argv[:2] == ["croupier", "serve"]
    data = mounts(coord)["coordinator-data"]
    assert option(argv, "--store") == f"sqlite:///{data}/croupier.db"
    port = option(argv, "--port")
    check = service_image(coord).healthcheck
    assert check is not None and coord["healthcheck"]["test"] == ["CMD", *check], "the Dockerfile's health check"

    trainers = [services["trainer-head"], services["trainer"]]
    head_argv = service_argv(services["trainer-head"])
    for t in trainers:
        assert service_argv(t) == head_argv
        assert t["environment"] == services["trainer-head"]["environment"]
        assert t["depends_on"]["coordinator"] == {"condition": "service_healthy"}
        assert mounts(t) == {"work": "/work"}
    env = services["trainer"]["environment"]
    assert env["CROUPIER_ADDRESS"] == f"coordinator:{port}"
    assert env["CROUPIER_JOB"]
    work = mounts(services["trainer"])["work"]
    assert json.loads(env["DEMO"])["workdir"] == work
    assert env["CROUPIER_AUDIT_DIR"].startswith(work + "/")

    audit = services["audit"]
    assert service_argv(audit) == ["croupier", "audit", env["CROUPIER_AUDIT_DIR"]]
    assert mounts(audit) == {"work": work}
    assert audit["depends_on"] == {"trainer-head": {"condition": "service_completed_successfully"}}


def test_compose_trainers_are_one_elastic_torchrun_job() -> None:
    services = compose()["services"]
    head = services["trainer-head"]
    args = torchrun_args(service_argv(head))
    assert args.module and args.training_script == TRAINER_MODULE
    assert importlib.util.find_spec(TRAINER_MODULE) is not None
    assert args.rdzv_backend == "c10d" and not args.standalone
    host, port = args.rdzv_endpoint.rsplit(":", 1)
    assert host == head["hostname"], "the rendezvous store runs on the container whose hostname is the endpoint's"
    assert port in service_image(head).exposed
    low, high = (int(n) for n in args.nnodes.split(":"))
    nodes = 1 + services["trainer"]["deploy"]["replicas"]
    assert low <= nodes <= high and args.nproc_per_node == "1"


# --- Dockerfiles and .dockerignore ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["coordinator", "trainer"])
def test_dockerfile(name: str) -> None:
    image = read_image(ROOT / "deploy" / "docker" / f"{name}.Dockerfile")
    assert image.base == "python:3.11-slim"
    uid = image.user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER must be a numeric non-root uid, so runAsNonRoot can check it (got {image.user!r})"
    assert set(BUILD_CONTEXT) <= set(image.copied)
    torch_cpu = [r for r in image.runs if "--index-url" in r and r.split()[-1] == "torch"]
    assert torch_cpu and "--constraint constraints.txt" in torch_cpu[0], "torch's CPU build, at the pinned version"
    assert any("--constraint constraints.txt ." in r for r in image.runs)
    assert image.entrypoint
    if name == "coordinator":
        assert image.entrypoint + image.cmd == service_argv(compose()["services"]["coordinator"])
        assert image.volumes == ["/data"] and image.exposed == ["50051"]
        assert image.healthcheck is not None and "grpc_health" in image.healthcheck[-1]
        assert f"127.0.0.1:{option(image.cmd, '--port')}" in image.healthcheck[-1]
    else:
        assert image.volumes == ["/work"]
        args = torchrun_args(image.entrypoint + image.cmd)
        assert args.module and args.training_script == TRAINER_MODULE


def test_dockerignore_keeps_the_build_context() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]

    def ignored(path: str) -> bool:
        return any(fnmatch.fnmatch(path, p.rstrip("/")) or fnmatch.fnmatch(path, p.rstrip("/").removeprefix("**/"))
                   for p in patterns)

    for path in BUILD_CONTEXT:
        assert not ignored(path), f"{path} is needed by the images"
    for path in (".git", ".venv", "out", "tests"):
        assert ignored(path), f"{path} does not belong in the build context"


# --- Kubernetes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("path", kube_files(), ids=lambda p: str(p.relative_to(KUBE)))
def test_kubernetes_manifest_validates(path: pathlib.Path, version: str) -> None:
    docs = kube_docs(path)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_kubernetes_validation_refuses_a_misspelt_field() -> None:
    sts = copy.deepcopy(kube("StatefulSet", "croupier"))
    pod_container(sts)["readinessProbe"]["grpc"]["prot"] = 50051
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, KUBE_VERSIONS[-1], strict=True)


def test_kustomizations_list_every_manifest() -> None:
    listed: list[pathlib.Path] = []
    for k in KUBE.rglob("kustomization.yaml"):
        spec = yaml.safe_load(k.read_text())
        resources = [k.parent / r for r in spec["resources"]]
        assert all(r.is_file() for r in resources), resources
        listed += resources
        used = {pod_container(d)["image"] for r in resources for d in kube_docs(r) if "template" in d.get("spec", {})}
        assert {f"{i['name']}:{i['newTag']}" for i in spec.get("images", [])} == used
    assert sorted(listed) == kube_files(), "every manifest in exactly one kustomization"


def test_coordinator_statefulset_service_and_budget() -> None:
    sts = kube("StatefulSet", "croupier")
    pod = sts["spec"]["template"]
    c = pod_container(sts)
    argv = c["command"] + c["args"]
    assert argv == service_argv(compose()["services"]["coordinator"]), "Kubernetes runs what compose runs"
    port = int(option(argv, "--port"))
    assert [p["containerPort"] for p in c["ports"]] == [port]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        grpc_probe = c[probe]["grpc"]
        assert grpc_probe["port"] == port and grpc_probe.get("service", "") in HEALTH_SERVICES
    assert sts["spec"]["replicas"] == 1

    (claim,) = sts["spec"]["volumeClaimTemplates"]
    mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}[claim["metadata"]["name"]]
    assert option(argv, "--store") == f"sqlite:///{mount}/croupier.db"
    uid = int(read_image(ROOT / "deploy" / "docker" / "coordinator.Dockerfile").user.split(":")[0])
    sec = pod["spec"]["securityContext"]
    assert sec["runAsNonRoot"] is True and sec["runAsUser"] == uid and sec["fsGroup"] == uid
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert set(c["resources"]) == {"requests", "limits"}

    labels = pod["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"] == labels
    assert kube("PodDisruptionBudget", "croupier")["spec"]["selector"]["matchLabels"] == labels
    service, headless = kube("Service", "croupier"), kube("Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    for s in (service, headless):
        assert s["spec"]["selector"].items() <= labels.items()
        assert [(p["port"], p["targetPort"]) for p in s["spec"]["ports"]] == [(port, c["ports"][0]["name"])]


def test_training_job_finds_the_coordinator_and_its_peers(tmp_path: pathlib.Path) -> None:
    job = kube("Job", "croupier-demo")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    c = pod_container(job)
    env = env_of(c)
    service = kube("Service", "croupier")
    assert env["CROUPIER_ADDRESS"] == f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    peers = kube("Service", pod["subdomain"])
    assert peers["spec"]["clusterIP"] == "None"
    assert peers["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]

    # The command as the pod's shell runs it (Kubernetes first turns $$ into $), with a torchrun that prints its argv.
    assert c["command"] == ["/bin/sh", "-c"]
    script = c["args"][0].replace("$$", "$")
    fake = tmp_path / "torchrun"
    fake.write_text("#!/bin/sh\nprintf '%s\\n' torchrun \"$@\"\n")
    fake.chmod(0o755)
    for index in range(spec["parallelism"]):
        out = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=30, check=True,
                             env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "JOB_COMPLETION_INDEX": str(index)})
        args = torchrun_args(out.stdout.splitlines())
        assert args.rdzv_conf == f"is_host={int(index == 0)}"
        assert args.rdzv_backend == "c10d"
        assert args.rdzv_endpoint == f"{job['metadata']['name']}-0.{pod['subdomain']}:{peers['spec']['ports'][0]['port']}"
        low, high = (int(n) for n in args.nnodes.split(":"))
        assert low <= spec["parallelism"] <= high
        assert args.module and args.training_script == TRAINER_MODULE

    work = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    (name,) = work
    assert json.loads(env["DEMO"])["workdir"] == mount[name]
    assert env["CROUPIER_AUDIT_DIR"].startswith(mount[name] + "/")
    kube("PersistentVolumeClaim", work[name])

    audit = kube("Job", "croupier-demo-audit")
    a = pod_container(audit)
    assert a["command"] + a["args"] == ["croupier", "audit", env["CROUPIER_AUDIT_DIR"]]
    a_claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in audit["spec"]["template"]["spec"]["volumes"]}
    assert {m["mountPath"]: a_claims[m["name"]] for m in a["volumeMounts"]} == {mount[name]: work[name]}


# --- the commands, for real -----------------------------------------------------------------------


@dataclasses.dataclass
class Running:
    proc: subprocess.Popen[str]
    first_line: str
    port: int
    store: pathlib.Path


@pytest.fixture
def coordinator(tmp_path: pathlib.Path) -> Iterator[Running]:
    """The compose file's coordinator command, with only the volume's path and the port replaced."""
    service = compose()["services"]["coordinator"]
    argv = service_argv(service)
    data = mounts(service)["coordinator-data"]
    host_data = tmp_path / "coordinator-data"
    host_data.mkdir()
    argv = replace_option(argv, "--store", option(argv, "--store").replace(data, str(host_data), 1))
    argv = replace_option(argv, "--port", "0")
    argv[0] = str(BIN / argv[0])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("listening on "):
            proc.kill()
            _, err = proc.communicate(timeout=10)
            raise AssertionError(f"croupier serve did not start: {line!r} {err}")
        store = pathlib.Path(option(argv, "--store").removeprefix("sqlite:///"))
        yield Running(proc, line, int(line.rsplit(":", 1)[1]), store)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_coordinator_runs_as_compose_and_kubernetes_say(coordinator: Running) -> None:
    host = option(service_argv(compose()["services"]["coordinator"]), "--host")
    assert coordinator.first_line == f"listening on {host}:{coordinator.port}\n"
    assert coordinator.store.is_file(), "the store lives on the volume"

    # The container's health check, as compose and the Dockerfile give it, against this port.
    check = compose()["services"]["coordinator"]["healthcheck"]["test"][1:]
    assert check[0] == "python"
    code = check[-1].replace("127.0.0.1:50051", f"127.0.0.1:{coordinator.port}")
    assert code != check[-1]
    r = subprocess.run([sys.executable, *check[1:-1], code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    # Every service the Kubernetes probes ask for.
    c = pod_container(kube("StatefulSet", "croupier"))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert health(f"127.0.0.1:{coordinator.port}", c[probe]["grpc"].get("service", "")) == health_pb2.HealthCheckResponse.SERVING

    coordinator.proc.send_signal(signal.SIGTERM)  # what `docker stop` and Kubernetes send
    assert coordinator.proc.wait(timeout=30) == 0
    r = subprocess.run([sys.executable, *check[1:-1], code], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0, "the health check must fail once the coordinator is gone"


@pytest.mark.e2e
def test_trainer_and_audit_run_as_the_images_say(coordinator: Running, tmp_path: pathlib.Path) -> None:
    """The trainer image's own command with the compose file's environment, then the audit service's command.

    Replaced: the work volume's path, the coordinator's address, and the dataset's size (to keep it short).
    """
    services = compose()["services"]
    trainer = services["trainer"]
    work = mounts(trainer)["work"]
    host_work = tmp_path / "work"
    host_work.mkdir()
    image = service_image(trainer)
    env = {k: v for k, v in image.env.items() if k != "PATH"} | trainer["environment"]
    env = {k: v.replace(work, str(host_work)) for k, v in env.items()}
    env["CROUPIER_ADDRESS"] = f"127.0.0.1:{coordinator.port}"
    env["DEMO"] = json.dumps(json.loads(env["DEMO"]) | {"n": 256, "epochs": 1})
    argv = image.entrypoint + image.cmd
    argv[0] = str(BIN / argv[0])
    r = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    audit = [a.replace(work, str(host_work)) for a in service_argv(services["audit"])]
    audit[0] = str(BIN / audit[0])
    r = subprocess.run(audit, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 finished epochs audited" in r.stdout and "G1 holds" in r.stdout


@pytest.mark.parametrize("name", ["coordinator", "trainer"])
def test_what_the_image_copies_builds_the_package(name: str, tmp_path: pathlib.Path) -> None:
    """`pip install .` in the image sees only what it COPYs: a wheel built from just that has every package."""
    image = read_image(ROOT / "deploy" / "docker" / f"{name}.Dockerfile")
    src = tmp_path / "src"
    src.mkdir()
    for path in image.copied:
        origin = ROOT / path.rstrip("/")
        if origin.is_dir():
            shutil.copytree(origin, src / path.rstrip("/"), ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(origin, src / path)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path / "wheel"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("croupier-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for pkg in ("core", "server", "client", "tools", "integrations", "v1"):
        assert f"croupier/{pkg}/__init__.py" in names, f"the image's package lacks croupier.{pkg}"


# --- the secure overlays: deploy/kubernetes-secure and deploy/compose.secure.yml -------------------

SECURE = ROOT / "deploy" / "kubernetes-secure"
COMPOSE_SECURE = ROOT / "deploy" / "compose.secure.yml"
HA = ROOT / "deploy" / "kubernetes-ha"
COMPOSE_HA = ROOT / "deploy" / "compose.ha.yml"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
#: What `croupier serve` needs for TLS and credentials: each names a file of a mounted Secret.
SECRET_OPTIONS = ("--tls-cert", "--tls-key", "--tls-client-ca", "--auth-file")
#: What every croupier client reads: each names a file of a mounted Secret.
CLIENT_FILES = ("CROUPIER_TLS_CA", "CROUPIER_TLS_CERT", "CROUPIER_TLS_KEY")


def kustomization_dirs() -> list[pathlib.Path]:
    return sorted(k.parent for base in (KUBE, SECURE, HA) for k in base.rglob("kustomization.yaml"))


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not installed: the overlays are built, and the Secrets made, by kubectl (offline)")
    return path


def kustomize(folder: pathlib.Path) -> list[dict[str, Any]]:
    """What `kubectl kustomize` makes of a folder: the overlays are checked as kubectl applies them (offline)."""
    r = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "KUBECONFIG": os.devnull})
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def built(folder: pathlib.Path, kind: str, name: str) -> dict[str, Any]:
    found = [d for d in kustomize(folder) if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name} in {folder}: {len(found)} manifests"
    return found[0]


def example_secrets() -> dict[str, dict[str, Any]]:
    """The Secrets the *.example.yaml files show, by name: what the overlays may mount."""
    return {d["metadata"]["name"]: d for p in sorted(SECURE.rglob("*.example.yaml")) for d in kube_docs(p)}


def secret_keys(secret: dict[str, Any]) -> set[str]:
    return set(secret.get("data", {})) | set(secret.get("stringData", {}))


def pod_volumes(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The volumes a workload's pods declare, by name: the pod's own and a StatefulSet's claims."""
    claims = {t["metadata"]["name"]: {"persistentVolumeClaim": t} for t in workload["spec"].get("volumeClaimTemplates", [])}
    return claims | {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}


def secret_files(workload: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Path in the container -> (Secret, key), for every key of every Secret volume the container mounts."""
    volumes, container = pod_volumes(workload), pod_container(workload)
    secrets = example_secrets()
    files = {}
    for m in container["volumeMounts"]:
        source = volumes[m["name"]].get("secret")
        if source is not None:
            assert source["secretName"] in secrets, f"{source['secretName']} is not in a secrets.example.yaml"
            for key in secret_keys(secrets[source["secretName"]]):
                files[f"{m['mountPath']}/{key}"] = (source["secretName"], key)
    return files


def write_secret_volume(folder: pathlib.Path, files: dict[str, bytes], version: str) -> None:
    """A Secret volume as the kubelet writes it: each key a link through ..data into a folder per version; an
    update writes a new folder and swaps ..data at once."""
    data = folder / f"..{version}"
    data.mkdir(parents=True)
    for key, value in files.items():
        (data / key).write_bytes(value)
        if not (folder / key).is_symlink():
            (folder / key).symlink_to(f"..data/{key}")
    (folder / "..data_tmp").symlink_to(data.name)
    os.replace(folder / "..data_tmp", folder / "..data")


def mount_secrets(root: pathlib.Path, workload: dict[str, Any], contents: dict[tuple[str, str], bytes]) -> dict[str, str]:
    """Writes the container's Secret volumes under `root`, at their paths in the container; returns path -> host path."""
    files = secret_files(workload)
    for mount in {path.rsplit("/", 1)[0] for path in files}:
        write_secret_volume(root / mount.lstrip("/"), {key: contents[(secret, key)] for path, (secret, key) in files.items()
                                                      if path.startswith(mount + "/")}, "v1")
    return {path: str(root / path.lstrip("/")) for path in files}


def container_env(container: dict[str, Any], contents: dict[tuple[str, str], bytes]) -> dict[str, str]:
    """The container's environment, its Secret references resolved."""
    env = {}
    for e in container.get("env", []):
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        env[e["name"]] = contents[(ref["name"], ref["key"])].decode() if ref else e["value"]
    return env


def croupier_args(argv: list[str], command: str) -> Any:
    """croupier's own parser over a `croupier ...` command line: unknown or misspelt options fail here."""
    from croupier.tools.cli import build_parser

    assert pathlib.Path(argv[0]).name == "croupier", argv
    args = build_parser().parse_args(argv[1:])
    assert args.command == command, argv
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def secure_compose() -> dict[str, Any]:
    with open(COMPOSE_SECURE) as f:
        return yaml.safe_load(f)


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("folder", kustomization_dirs(), ids=lambda p: str(p.relative_to(ROOT / "deploy")))
def test_every_kustomization_builds_and_validates(folder: pathlib.Path, version: str) -> None:
    docs = kustomize(folder)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_secure_folder_holds_kustomizations_their_patches_and_examples() -> None:
    patches, examples = set(), set(SECURE.rglob("*.example.yaml"))
    for k in SECURE.rglob("kustomization.yaml"):
        spec = yaml.safe_load(k.read_text())
        assert all((k.parent / r / "kustomization.yaml").is_file() for r in spec["resources"]), "overlays of a base"
        patches |= {k.parent / p["path"] for p in spec["patches"] if "path" in p}
        assert not any(d["kind"] == "Secret" for d in kustomize(k.parent)), "Secrets are the operator's, not applied"
    assert sorted(p for p in SECURE.rglob("*.yaml") if p.name != "kustomization.yaml") == sorted(patches | examples)
    for name, secret in example_secrets().items():
        assert secret["kind"] == "Secret", name
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(secret, version, strict=True)
    assert example_secrets()["croupier-tls"]["type"] == "kubernetes.io/tls"


def kubectl_create_secret_commands(path: pathlib.Path) -> list[str]:
    """The `kubectl create secret` commands in a file's comments, continuation lines joined."""
    lines = [line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")]
    commands = []
    for i, line in enumerate(lines):
        while line.startswith("kubectl create secret") and line.endswith("\\"):
            i += 1
            line = line[:-1] + lines[i]
        if line.startswith("kubectl create secret"):
            commands.append(line)
    return commands


def dry_run(command: str, tmp_path: pathlib.Path) -> dict[str, Any]:
    """What a `kubectl create secret` command makes, with --dry-run=client (no cluster); the files it reads made here."""
    argv = shlex.split(command)
    for i, arg in enumerate(argv):
        if arg.startswith("--from-file="):
            key, _, source = arg.removeprefix("--from-file=").partition("=")
            (tmp_path / source).write_text(key)
            argv[i] = f"--from-file={key}={tmp_path / source}"
    assert argv[0] == "kubectl", command
    r = subprocess.run([kubectl(), *argv[1:], "--dry-run=client", "-o", "json"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "KUBECONFIG": os.devnull})
    assert r.returncode == 0, f"{command}: {r.stderr}"
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def test_example_secrets_are_what_their_kubectl_commands_create(tmp_path: pathlib.Path) -> None:
    """The `kubectl create secret` commands in the examples' comments, run with --dry-run=client (no cluster)."""
    secrets = example_secrets()
    made = set()
    for path in SECURE.rglob("*.example.yaml"):
        commands = kubectl_create_secret_commands(path)
        assert commands, path
        for command in commands:
            out = dry_run(command, tmp_path)
            name = out["metadata"]["name"]
            want = secrets[name]
            assert (out.get("type", "Opaque"), set(out["data"])) == (want.get("type", "Opaque"), secret_keys(want)), command
            made.add(name)
    assert made == set(secrets), "a command for every Secret"


def test_secure_overlay_changes_only_tls_credentials_probes_and_metrics() -> None:
    base, sts = kube("StatefulSet", "croupier"), built(SECURE, "StatefulSet", "croupier")
    c, base_c = pod_container(sts), pod_container(base)
    argv = c["command"] + c["args"]
    base_argv = base_c["command"] + base_c["args"]
    assert argv[:len(base_argv)] == base_argv, "the base's command, then the overlay's options"
    args = croupier_args(argv, "serve")
    assert args.tls_cert and args.tls_key and args.tls_client_ca and args.auth_file, "TLS, mutual TLS and credentials"
    assert args.log_format == "json"

    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": args.port, "metrics": args.metrics_port} and args.metrics_host == "0.0.0.0"
    scrape = sts["spec"]["template"]["metadata"]["annotations"]
    assert scrape == {"prometheus.io/scrape": "true", "prometheus.io/port": str(args.metrics_port),
                      "prometheus.io/path": "/metrics"}

    env = env_of(c)
    assert env["CROUPIER_TLS_SERVER_NAME"] == kube("Service", "croupier")["metadata"]["name"], "the name trainers dial"
    for probe in PROBES:
        handlers = set(c[probe]) & {"exec", "grpc", "httpGet", "tcpSocket"}
        assert handlers == {"exec"}, f"{probe}: one handler, exec (got {handlers})"
        health_args = croupier_args(c[probe]["exec"]["command"], "health")
        assert health_args.address == f"127.0.0.1:{args.port}"
        assert health_args.service == base_c[probe]["grpc"].get("service", ""), "what the base's probe asks"
        assert c[probe]["timeoutSeconds"] >= 5, "croupier health imports torch: give it time"

    # Everything else is the base's; the Services lose only appProtocol (h2c: HTTP/2 in the clear).
    mounts_, volumes = c["volumeMounts"], sts["spec"]["template"]["spec"]["volumes"]
    assert all(m in mounts_ for m in base_c["volumeMounts"]) and all(v in volumes for v in base["spec"]["template"]["spec"]["volumes"])
    for doc in (sts, base):
        pod = doc["spec"]["template"]
        pod["metadata"].pop("annotations", None)
        pod["spec"].pop("volumes")
        for key in ("args", "env", "ports", "volumeMounts", *PROBES):
            pod_container(doc).pop(key, None)
    assert sts == base
    for name in ("croupier", "croupier-headless"):
        service = built(SECURE, "Service", name)
        assert all("appProtocol" not in p for p in service["spec"]["ports"])
        assert [{**p, "appProtocol": "kubernetes.io/h2c"} for p in service["spec"]["ports"]] == kube("Service", name)["spec"]["ports"]


@pytest.mark.parametrize("folder, kind, name", [(SECURE, "StatefulSet", "croupier"), (SECURE / "demo", "Job", "croupier-demo")],
                         ids=["coordinator", "demo-trainer"])
def test_secure_pods_mount_the_secrets_they_name(folder: pathlib.Path, kind: str, name: str) -> None:
    workload = built(folder, kind, name)
    c, volumes = pod_container(workload), pod_volumes(workload)
    assert all(m["name"] in volumes for m in c["volumeMounts"]), "every mount, of a declared volume"
    secret_mounts = [m for m in c["volumeMounts"] if "secret" in volumes[m["name"]]]
    assert secret_mounts
    for m in secret_mounts:
        assert m.get("readOnly") is True and "subPath" not in m, "read-only, and a whole volume: updates reach the pod"
        assert "items" not in volumes[m["name"]]["secret"]
    files = secret_files(workload)
    named = [option(c["command"] + c.get("args", []), o) for o in SECRET_OPTIONS] if kind == "StatefulSet" else []
    env = {e["name"]: e for e in c["env"]}
    named += [env[v]["value"] for v in CLIENT_FILES]
    for path in named:
        assert path in files, f"{path} is no key of a mounted Secret: {sorted(files)}"
    for path in c["command"] + c.get("args", []) + [e.get("value", "") for e in c["env"]]:
        if any(path.startswith(m["mountPath"] + "/") for m in secret_mounts):
            assert path in files, f"{path} is no key of a mounted Secret"
    if kind == "Job":
        ref = env["CROUPIER_CREDENTIAL"]["valueFrom"]["secretKeyRef"]
        assert ref["key"] in secret_keys(example_secrets()[ref["name"]])


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A CA (EC P-256); the coordinator's certificate as secrets.example.yaml asks (the names clients dial in
    Kubernetes and in compose, serverAuth and clientAuth); a trainer's (clientAuth); one without clientAuth."""
    d = tmp_path_factory.mktemp("pki")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=croupier test CA")
    extensions = {
        "coordinator": "subjectAltName=DNS:croupier,DNS:croupier.croupier.svc,DNS:coordinator\n"
                       "extendedKeyUsage=serverAuth,clientAuth\n",
        "trainer": "extendedKeyUsage=clientAuth\n",
        "server-only": "subjectAltName=DNS:croupier\nextendedKeyUsage=serverAuth\n",
    }
    for who, ext in extensions.items():
        (d / f"{who}.ext").write_text(ext)
        openssl("req", *ec, "-keyout", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN={who}")
        openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{who}.pem", "-days", "2", "-extfile", f"{who}.ext")
    return d


def secret_contents(pki: pathlib.Path) -> dict[tuple[str, str], bytes]:
    """What the Secrets hold here: certificates made by `pki`, and the examples' own credentials."""
    examples = example_secrets()
    pem = {name: (pki / name).read_bytes() for name in ("ca.pem", "coordinator.pem", "coordinator.key", "trainer.pem", "trainer.key")}
    return {
        ("croupier-tls", "tls.crt"): pem["coordinator.pem"], ("croupier-tls", "tls.key"): pem["coordinator.key"],
        ("croupier-tls", "ca.crt"): pem["ca.pem"],
        ("croupier-credentials", "credentials.json"): examples["croupier-credentials"]["stringData"]["credentials.json"].encode(),
        ("croupier-demo-tls", "tls.crt"): pem["trainer.pem"], ("croupier-demo-tls", "tls.key"): pem["trainer.key"],
        ("croupier-demo-tls", "ca.crt"): pem["ca.pem"],
        ("croupier-demo-credential", "credential"): examples["croupier-demo-credential"]["stringData"]["credential"].encode(),
    }


@dataclasses.dataclass
class SecurePod:
    proc: subprocess.Popen[str]
    port: int
    metrics_port: int
    host_paths: dict[str, str]  # a file of a mounted Secret, as the container names it -> where it is here
    env: dict[str, str]  # the container's environment, its paths replaced by host_paths


def run_health(command: list[str], env: dict[str, str], port: int) -> subprocess.CompletedProcess[str]:
    """A probe's command against `port`, with `env` for the environment's CROUPIER_* variables."""
    argv = replace_option(command, "--address", f"127.0.0.1:{port}")
    argv[0] = str(BIN / argv[0])
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CROUPIER_")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env={**clean, **env})


@pytest.fixture
def secure_coordinator(pki: pathlib.Path, tmp_path: pathlib.Path) -> Iterator[SecurePod]:
    """The secure overlay's coordinator command, run here: its Secret volumes written under tmp_path as the kubelet
    writes them, and only those paths, the store's, the ports and the interfaces (loopback) replaced.

    NOTE: `croupier serve` prints only the gRPC address, so the metrics port is one found free here.
    """
    sts = built(SECURE, "StatefulSet", "croupier")
    c = pod_container(sts)
    host_paths = mount_secrets(tmp_path / "pod", sts, secret_contents(pki))
    argv = [host_paths.get(a, a) for a in c["command"] + c["args"]]
    for name, value in {"--store": f"sqlite:///{tmp_path}/croupier.db", "--port": "0", "--host": "127.0.0.1",
                        "--metrics-port": str(free_port()), "--metrics-host": "127.0.0.1"}.items():
        argv = replace_option(argv, name, value)
    argv[0] = str(BIN / argv[0])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("listening on "):
            proc.kill()
            _, err = proc.communicate(timeout=10)
            raise AssertionError(f"croupier serve did not start: {line!r} {err}")
        env = {k: host_paths.get(v, v) for k, v in env_of(c).items()}
        yield SecurePod(proc, int(line.rsplit(":", 1)[1]), int(option(argv, "--metrics-port")), host_paths, env)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_secure_coordinator_answers_its_probes(secure_coordinator: SecurePod, pki: pathlib.Path) -> None:
    pod = secure_coordinator
    c = pod_container(built(SECURE, "StatefulSet", "croupier"))
    for probe in PROBES:
        r = run_health(c[probe]["exec"]["command"], pod.env, pod.port)
        assert (r.returncode, r.stdout) == (0, "SERVING\n"), f"{probe}: {r.stderr}"

    # Mutual TLS: without a client certificate, or with one not meant for clients, the probe fails.
    command = c["readinessProbe"]["exec"]["command"] + ["--timeout", "3"]
    no_cert = {k: v for k, v in pod.env.items() if k not in ("CROUPIER_TLS_CERT", "CROUPIER_TLS_KEY")}
    r = run_health(command, no_cert, pod.port)
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr, r.stdout + r.stderr
    server_only = {**pod.env, "CROUPIER_TLS_CERT": str(pki / "server-only.pem"), "CROUPIER_TLS_KEY": str(pki / "server-only.key")}
    assert run_health(command, server_only, pod.port).returncode == 1, "a certificate without clientAuth"

    # The compose override's health check, against the same command line (its paths are the overlay's).
    coordinator = secure_compose()["services"]["coordinator"]
    env = {k: pod.host_paths.get(v, v) for k, v in coordinator["environment"].items()}
    r = run_health(coordinator["healthcheck"]["test"][1:], env, pod.port)
    assert (r.returncode, r.stdout) == (0, "SERVING\n"), r.stderr

    # What Prometheus scrapes, where the pod's annotations say (plain HTTP).
    path = built(SECURE, "StatefulSet", "croupier")["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"]
    with urllib.request.urlopen(f"http://127.0.0.1:{pod.metrics_port}{path}", timeout=10) as reply:
        assert reply.status == 200 and b"# TYPE " in reply.read()

    pod.proc.send_signal(signal.SIGTERM)
    assert pod.proc.wait(timeout=30) == 0


def test_demo_trainer_reaches_the_secure_coordinator(secure_coordinator: SecurePod, pki: pathlib.Path,
                                                     tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo overlay's trainer environment, its Secrets the examples' (credential) and `pki`'s (certificate)."""
    from croupier.client._rpc import CoordinatorClient
    from croupier.core.api import JoinRequest
    from croupier.core.spec import Spec

    job = built(SECURE / "demo", "Job", "croupier-demo")
    c = pod_container(job)
    contents = secret_contents(pki)
    host_paths = mount_secrets(tmp_path / "trainer", job, contents)
    env = {k: host_paths.get(v, v) for k, v in container_env(c, contents).items()}
    for k in [k for k in os.environ if k.startswith("CROUPIER_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # In the cluster it dials CROUPIER_ADDRESS, and the certificate must carry that name; here it dials 127.0.0.1.
    monkeypatch.setenv("CROUPIER_TLS_SERVER_NAME", env["CROUPIER_ADDRESS"].rsplit(":", 1)[0])
    address, spec = f"127.0.0.1:{secure_coordinator.port}", Spec(n=100, seed=0)
    with CoordinatorClient(address, retry_for=10.0) as client:
        assert client.join(JoinRequest(env["CROUPIER_JOB"], spec, "t1", 1, 0), wait_s=5.0).start is not None
        with pytest.raises(PermissionError, match="may not call Join for job 'another-job'"):
            client.join(JoinRequest("another-job", spec, "t1", 1, 0), wait_s=0)
    monkeypatch.delenv("CROUPIER_CREDENTIAL")
    with CoordinatorClient(address, retry_for=10.0) as client:
        with pytest.raises(PermissionError, match="needs a credential"):
            client.jobs()


def test_secure_coordinator_takes_an_updated_credentials_secret(secure_coordinator: SecurePod, pki: pathlib.Path) -> None:
    """Rotation: the kubelet swaps in the edited Secret (..data), and the next calls see the new credentials."""
    from croupier.client import Security
    from croupier.client._rpc import CoordinatorClient
    from croupier.server._auth import digest

    pod = secure_coordinator
    path = pod.host_paths["/etc/croupier/auth/credentials.json"]
    old = example_secrets()["croupier-demo-credential"]["stringData"]["credential"]
    new = "the-rotated-secret-0123456789"
    tls = {"tls": True, "ca": pod.env["CROUPIER_TLS_CA"], "cert": str(pki / "trainer.pem"), "key": str(pki / "trainer.key"),
           "server_name": pod.env["CROUPIER_TLS_SERVER_NAME"]}

    def accepted(secret: str) -> bool:
        with CoordinatorClient(f"127.0.0.1:{pod.port}", retry_for=5.0, security=Security(**tls, credential=secret)) as c:
            try:
                c.jobs()
            except PermissionError:
                return False
            return True

    assert accepted(old) and not accepted(new)
    doc = json.loads(pathlib.Path(path).read_text())
    doc["credentials"][0]["sha256"] = digest(new).hex()
    write_secret_volume(pathlib.Path(path).parent, {"credentials.json": json.dumps(doc).encode()}, "v2")
    deadline = time.monotonic() + 20  # the coordinator looks at the file at most once a second
    while accepted(old) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert accepted(new) and not accepted(old)


def test_compose_secure_override_is_the_overlay_for_one_host() -> None:
    r = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(COMPOSE_SECURE)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    base, services = compose()["services"], secure_compose()["services"]
    assert set(services) <= set(base)
    coord = services["coordinator"]
    sts = built(SECURE, "StatefulSet", "croupier")
    c = pod_container(sts)
    argv = service_argv({**base["coordinator"], "command": coord["command"]})
    assert argv == c["command"] + c["args"], "compose runs what the Kubernetes overlay runs"
    files = secret_files(sts)
    env = coord["environment"]
    k8s_env = env_of(c)
    assert env.keys() == k8s_env.keys() and all(env[v] == k8s_env[v] for v in CLIENT_FILES), "the probes' settings"
    host = base["trainer"]["environment"]["CROUPIER_ADDRESS"].rsplit(":", 1)[0]
    assert env["CROUPIER_TLS_SERVER_NAME"] == host, "the name the trainers dial"

    def mounted(service: dict[str, Any]) -> dict[str, str]:
        """Folder in the container -> folder on the host, for the bind mounts of deploy/secrets/."""
        binds = [v.split(":") for v in service["volumes"]]
        assert all(source.startswith("./deploy/secrets/") and mode == "ro" for source, _, mode in binds)
        return {target: source for source, target, _ in binds}

    folders = mounted(coord)
    assert {path.rsplit("/", 1)[0] for path in files} == set(folders), "the overlay's Secret volumes, at their paths"
    check = croupier_args(coord["healthcheck"]["test"][1:], "health")
    assert coord["healthcheck"]["test"][0] == "CMD" and check.address == f"127.0.0.1:{option(argv, '--port')}"
    for name in ("trainer-head", "trainer"):
        trainer = services[name]
        trainer_folders = mounted(trainer)
        assert all(trainer["environment"][v].rsplit("/", 1)[0] in trainer_folders for v in CLIENT_FILES)
        assert trainer["env_file"].startswith("deploy/secrets/"), "CROUPIER_CREDENTIAL, kept out of the file"
        assert not set(trainer_folders.values()) & set(folders.values()), "the trainers see none of the coordinator's keys"


# --- high availability: deploy/compose.ha.yml and deploy/kubernetes-ha -----------------------------

#: The compose file's coordinator replicas, in the order the trainers' address list names them.
REPLICAS = ("coordinator-1", "coordinator-2", "coordinator-3")
#: The Secret (and its key) the Kubernetes replicas read their store's URL from.
DATABASE_SECRET = ("croupier-database", "url")
#: What kubernetes-ha/ holds besides its kustomization's resources: neither is applied by it.
HA_NOT_APPLIED = ("secrets.example.yaml", "dev-postgres.yaml")


def compose_ha() -> dict[str, Any]:
    with open(COMPOSE_HA) as f:
        return yaml.safe_load(f)


def interpolate(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's `${NAME:-default}` and `${NAME}` in a value, from `env` (default: nothing set)."""
    env = env or {}
    out = re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: env.get(m[1]) or m[2] or "", value)
    assert "$" not in out, f"an interpolation this test does not know: {value!r}"
    return out


def store_url(url: str) -> urllib.parse.SplitResult:
    """A store URL, checked to be one `croupier serve` opens as PostgreSQL."""
    from croupier.server._store import parse_url

    assert parse_url(url)[0] == "postgresql", url
    return urllib.parse.urlsplit(url)


def serve_args(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """croupier's own parser over a `croupier serve` command line, in a container's environment."""
    for k in [k for k in os.environ if k.startswith("CROUPIER_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return croupier_args(argv, "serve")


def requirement_names(specs: list[str]) -> set[str]:
    return {Requirement(spec).name.lower().replace("_", "-") for spec in specs}


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


@dataclasses.dataclass
class Replica:
    proc: subprocess.Popen[str]
    address: str
    workdir: pathlib.Path  # the process's working directory: what it would write to the container's disk


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
