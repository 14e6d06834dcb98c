"""The compose files (docker-compose.yml and the secure override), checked offline against the compose spec."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import pathlib
import subprocess
import sys
from typing import Any

import yaml
from _deploy import (
    CLIENT_FILES,
    COMPOSE,
    COMPOSE_SECURE,
    SECURE,
    TRAINER_MODULE,
    built,
    compose,
    croupier_args,
    env_of,
    mounts,
    option,
    pod_container,
    secret_files,
    secure_compose,
    service_argv,
    service_image,
    torchrun_args,
)


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
