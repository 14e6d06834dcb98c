"""What the deploy tests share: reading the compose files, Dockerfiles and manifests, and running what they say."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shlex
import shutil
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
from typing import Any

import grpc
import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser
from grpc_health.v1 import health_pb2, health_pb2_grpc
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parent.parent


COMPOSE = ROOT / "docker-compose.yml"


KUBE = ROOT / "deploy" / "kubernetes"


BIN = pathlib.Path(sys.executable).parent


TRAINER_MODULE = "croupier.demos.demo_train"


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


@dataclasses.dataclass
class Running:
    proc: subprocess.Popen[str]
    first_line: str
    port: int
    store: pathlib.Path


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


@dataclasses.dataclass
class Replica:
    proc: subprocess.Popen[str]
    address: str
    workdir: pathlib.Path  # the process's working directory: what it would write to the container's disk
