"""The secure overlay for real: a coordinator with TLS, mutual TLS and credentials, as its pods run it."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest
from _deploy import (
    BIN,
    PROBES,
    SECURE,
    SecurePod,
    built,
    container_env,
    env_of,
    example_secrets,
    free_port,
    mount_secrets,
    option,
    pod_container,
    replace_option,
    run_health,
    secret_contents,
    secure_compose,
    write_secret_volume,
)

pytestmark = pytest.mark.e2e  # coordinator processes of their own, as the pods run them


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

    # What Prometheus scrapes, where the pod's annotations say: HTTPS with the port's certificate, a client
    # certificate (mutual TLS) and a bearer credential of the credentials file (the demo's, here).
    notes = built(SECURE, "StatefulSet", "croupier")["spec"]["template"]["metadata"]["annotations"]
    url = f"{notes['prometheus.io/scheme']}://127.0.0.1:{pod.metrics_port}{notes['prometheus.io/path']}"
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    ctx.check_hostname = False  # the certificate names the Service; here it is dialled at 127.0.0.1
    ctx.load_cert_chain(str(pki / "trainer.pem"), str(pki / "trainer.key"))
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(url, timeout=10, context=ctx)
    credential = secret_contents(pki)[("croupier-demo-credential", "credential")].decode().strip()
    scrape = urllib.request.Request(url, headers={"Authorization": f"Bearer {credential}"})
    with urllib.request.urlopen(scrape, timeout=10, context=ctx) as reply:
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
