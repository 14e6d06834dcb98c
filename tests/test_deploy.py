"""The deploy files: compose, Kubernetes and Docker checked offline, and the commands they run, run for real."""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import importlib.util
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from typing import Any

import grpc
import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser
from grpc_health.v1 import health_pb2, health_pb2_grpc

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


def service_image(service: dict[str, Any]) -> Image:
    build = service["build"]
    return read_image(COMPOSE.parent / build["context"] / build["dockerfile"])


def as_list(value: str | list[str]) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else list(value)


def service_argv(service: dict[str, Any]) -> list[str]:
    """What the container runs: Docker's rule for entrypoint and command over the image's ENTRYPOINT and CMD."""
    image = service_image(service)
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
