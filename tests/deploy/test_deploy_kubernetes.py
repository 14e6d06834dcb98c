"""The Kubernetes manifests and kustomizations: validated offline, built with kubectl kustomize."""

from __future__ import annotations

import copy
import json
import os
import pathlib
import subprocess

import kubernetes_validate
import pytest
import yaml
from _deploy import (
    CLIENT_FILES,
    HEALTH_SERVICES,
    KUBE,
    KUBE_VERSIONS,
    PROBES,
    ROOT,
    SECRET_OPTIONS,
    SECURE,
    TRAINER_MODULE,
    built,
    compose,
    croupier_args,
    dry_run,
    env_of,
    example_secrets,
    kube,
    kube_docs,
    kube_files,
    kubectl_create_secret_commands,
    kustomization_dirs,
    kustomize,
    option,
    pod_container,
    pod_volumes,
    read_image,
    secret_files,
    secret_keys,
    service_argv,
    torchrun_args,
)


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
                      "prometheus.io/path": "/metrics", "prometheus.io/scheme": "https"}

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
