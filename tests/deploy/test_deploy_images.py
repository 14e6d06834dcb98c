"""The Dockerfiles and .dockerignore checked offline, and the commands the images run, run for real."""

from __future__ import annotations

import fnmatch
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterator

import pytest
from _deploy import (
    BIN,
    BUILD_CONTEXT,
    ROOT,
    TRAINER_MODULE,
    Running,
    compose,
    health,
    kube,
    mounts,
    option,
    pod_container,
    read_image,
    replace_option,
    service_argv,
    service_image,
    torchrun_args,
)
from grpc_health.v1 import health_pb2


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


@pytest.mark.exhaustive  # a wheel built by pip, seconds each: in make test, not in make check
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
    for pkg in ("core", "server", "client", "tools", "harness", "demos", "integrations", "v1"):
        assert f"croupier/{pkg}/__init__.py" in names, f"the image's package lacks croupier.{pkg}"
