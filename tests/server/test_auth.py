"""TLS, mutual TLS and per-job credentials, over a real TLS server: every RPC x every kind of caller."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest
from _pki import make_pki
from _ranks import on_ranks
from grpc_health.v1 import health_pb2, health_pb2_grpc

from croupier.client import DistributedSampler, Security
from croupier.client._rpc import CoordinatorClient
from croupier.core.api import JoinRequest
from croupier.core.order import fresh
from croupier.core.spec import Spec
from croupier.core.wire import SERVICE, cursor_to_proto, spec_to_proto
from croupier.server import Server, ServerOptions
from croupier.server._auth import Authorizer, digest, parse
from croupier.v1 import coordinator_pb2 as pb

SPEC = Spec(n=1000, seed=3)
SECRETS = {"admin": "admin-secret-0123456789", "train": "train-secret-0123456789", "read": "read-secret-0123456789",
           "other": "other-secret-0123456789"}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A CA, a server certificate for localhost / 127.0.0.1 and a client certificate (tests/_pki.py)."""
    return make_pki(tmp_path_factory.mktemp("pki"))


def _creds_file(d: pathlib.Path) -> pathlib.Path:
    path = d / "credentials.json"
    path.write_text(json.dumps({"credentials": [
        {"name": "ops", "sha256": digest(SECRETS["admin"]).hex(), "role": "admin"},
        {"name": "team-j", "sha256": digest(SECRETS["train"]).hex(), "role": "train", "jobs": ["j", "j-*"]},
        {"name": "dash", "secret": SECRETS["read"], "role": "read", "jobs": ["j"]},
        {"name": "team-other", "sha256": digest(SECRETS["other"]).hex(), "role": "train", "jobs": ["other*"]},
    ]}))
    return path


@pytest.fixture
def tls_server(pki: pathlib.Path, tmp_path: pathlib.Path) -> Iterator[Server]:
    opts = ServerOptions(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"), auth_file=str(_creds_file(tmp_path)))
    s = Server(f"sqlite:///{tmp_path}/c.db", options=opts).start()
    try:
        yield s
    finally:
        s.stop(grace=0.5)


def _security(pki: pathlib.Path, who: str | None, cert: bool = False) -> Security:
    client = {"cert": str(pki / "client.pem"), "key": str(pki / "client.key")} if cert else {}
    return Security(tls=True, ca=str(pki / "ca.pem"), credential=SECRETS[who] if who else None, **client)


def _started(server: Server, pki: pathlib.Path) -> int:
    with CoordinatorClient(server.address, retry_for=5.0, security=_security(pki, "admin")) as c:
        out = on_ranks(2, lambda r: c.join_started(JoinRequest("j", SPEC, "t1", 2, r), timeout=20))
    return int(out[0].generation)


def _requests(gen: int) -> dict[str, bytes]:
    """One well-formed request per RPC, about job "j"."""
    join = pb.JoinRequest(request_id="again", job="j", spec=spec_to_proto(SPEC), incarnation="t1", world=2, rank=0)
    ckpt = pb.Checkpoint(step=1, cursor=cursor_to_proto(fresh(SPEC, 0)))
    return {
        "Join": join.SerializeToString(),
        "Lease": pb.LeaseRequest(job="j", generation=gen, rank=0, epoch=0, first_batch=0, count=4).SerializeToString(),
        "Grant": pb.GrantRequest(job="j", generation=gen, rank=0, epoch=0, first_batch=0, count=4).SerializeToString(),
        "GetJob": pb.GetJobRequest(job="j").SerializeToString(),
        "Report": pb.ReportRequest(job="j", generation=gen, rank=1, progress=pb.Progress(epoch=0, batches=2),
                                   checkpoint=ckpt).SerializeToString(),
        "GetCheckpoint": pb.GetCheckpointRequest(job="j", step=1).SerializeToString(),
        "ListJobs": pb.ListJobsRequest().SerializeToString(),
        "Amend": pb.AmendRequest(job="j", kind="skip", values=[0]).SerializeToString(),
    }


READS = {"GetJob", "GetCheckpoint", "ListJobs"}
#: caller -> RPC -> the refusal it gets (None: it is let through to the coordinator)
EXPECTED: dict[str, dict[str, grpc.StatusCode | None]] = {
    "none": dict.fromkeys(_requests(1), grpc.StatusCode.UNAUTHENTICATED),
    "unknown": dict.fromkeys(_requests(1), grpc.StatusCode.UNAUTHENTICATED),
    "other": {m: None if m == "ListJobs" else grpc.StatusCode.PERMISSION_DENIED for m in _requests(1)},
    "read": {m: None if m in READS else grpc.StatusCode.PERMISSION_DENIED for m in _requests(1)},
    "train": dict.fromkeys(_requests(1)),
    "admin": dict.fromkeys(_requests(1)),
}


def test_every_rpc_for_every_caller(tls_server: Server, pki: pathlib.Path) -> None:
    """Refused calls change nothing (byte for byte); calls let through reach the coordinator."""
    gen = _started(tls_server, pki)
    creds = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes())
    with grpc.secure_channel(tls_server.address, creds) as ch:
        for caller, expected in EXPECTED.items():
            secret = {"none": None, "unknown": "not-a-known-secret-at-all"}.get(caller, SECRETS.get(caller))
            md = [("authorization", f"Bearer {secret}")] if secret else []
            for method, payload in _requests(gen).items():
                before = tls_server.core.snapshot_state()
                call = ch.unary_unary(f"/{SERVICE}/{method}")
                try:
                    reply = call(payload, metadata=md, timeout=10)
                    code = grpc.StatusCode.OK
                except grpc.RpcError as e:
                    code, reply = e.code(), e.details()
                want = expected[method]
                if want is not None:
                    assert code == want, (caller, method, code, reply)
                    assert tls_server.core.snapshot_state() == before, f"{caller} {method}: a refused call changed the state"
                    assert all(s not in str(reply) for s in SECRETS.values()), "a secret in an error message"
                else:
                    assert code not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED), (caller, method)
                if method == "ListJobs" and code == grpc.StatusCode.OK:
                    jobs = list(pb.ListJobsResponse.FromString(reply).jobs)
                    assert jobs == ([] if caller == "other" else ["j"]), (caller, jobs)


def test_another_jobs_credential_cannot_fence_a_running_job(tls_server: Server, pki: pathlib.Path) -> None:
    """The zombie-fencing attack: a new incarnation for job "j", from team "other"'s credential."""
    gen = _started(tls_server, pki)
    before = tls_server.core.snapshot_state()
    with CoordinatorClient(tls_server.address, retry_for=2.0, security=_security(pki, "other")) as c:
        with pytest.raises(PermissionError, match="credential 'team-other' may not call Join for job 'j'"):
            c.join(JoinRequest("j", SPEC, "attacker", 2, 0), wait_s=0)
    assert tls_server.core.snapshot_state() == before
    with CoordinatorClient(tls_server.address, retry_for=2.0, security=_security(pki, "train")) as c:
        assert c.grant("j", gen, 0, 0, 0, 4).batches == 4  # the job's own ranks go on


def test_samplers_train_over_tls_with_their_credential(tls_server: Server, pki: pathlib.Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The client settings from the environment, as a trainer sets them."""
    monkeypatch.setenv("CROUPIER_TLS_CA", str(pki / "ca.pem"))
    monkeypatch.setenv("CROUPIER_CREDENTIAL", SECRETS["train"])
    samplers = [DistributedSampler(100, num_replicas=2, rank=r, address=tls_server.address, job="j-tls", incarnation="a")
                for r in range(2)]
    got = on_ranks(2, lambda r: list(samplers[r]))
    assert sorted(got[0] + got[1]) == list(range(100))
    monkeypatch.setenv("CROUPIER_CREDENTIAL", SECRETS["read"])
    reader = DistributedSampler(100, num_replicas=1, rank=0, address=tls_server.address, job="j", incarnation="b")
    with pytest.raises(PermissionError, match="Join needs role 'train' and it has 'read'"):
        next(iter(reader))
    for s in (*samplers, reader):
        s.close()


def test_a_reloaded_credentials_file_takes_effect(tmp_path: pathlib.Path, pki: pathlib.Path) -> None:
    path = _creds_file(tmp_path)
    auth = Authorizer(path=str(path))
    doc = json.loads(path.read_text())
    doc["credentials"] = [c for c in doc["credentials"] if c["name"] != "dash"]
    path.write_text(json.dumps(doc))
    assert auth.reload() and "dash" not in {c.name for c in auth._credentials}
    path.write_text("{ not json")
    assert not auth.reload() and len(auth._credentials) == 3  # a broken file keeps the credentials in force


@pytest.mark.parametrize("doc, words", [
    ({"credentials": [{"name": "a", "role": "read"}]}, "exactly one of sha256 and secret"),
    ({"credentials": [{"name": "a", "sha256": "ab", "role": "read"}]}, "sha256 must be 64 hex digits"),
    ({"credentials": [{"name": "a", "secret": "short", "role": "read"}]}, "at least 16 characters"),
    ({"credentials": [{"name": "a", "secret": "x" * 16, "role": "root"}]}, "role must be one of"),
    ({"credentials": [{"name": "a", "secret": "x" * 16, "role": "read", "jobs": []}]}, "jobs must be a non-empty list"),
    ({"credentials": [{"name": "a", "secret": "x" * 16, "role": "read", "extra": 1}]}, "unknown fields"),
    ({"credentials": [{"name": "a", "secret": "x" * 16, "role": "read"}] * 2}, "appears twice"),
    ({"users": []}, "must be"),
])
def test_a_bad_credentials_file_is_refused_naming_why(doc: object, words: str) -> None:
    with pytest.raises(ValueError, match=words) as e:
        parse(doc, "creds.json")
    assert "x" * 16 not in str(e.value)


def test_mutual_tls_refuses_a_client_without_a_certificate(pki: pathlib.Path, tmp_path: pathlib.Path) -> None:
    opts = ServerOptions(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"), tls_client_ca=str(pki / "ca.pem"),
                         auth_file=str(_creds_file(tmp_path)))
    with Server(f"sqlite:///{tmp_path}/m.db", options=opts) as server:
        with CoordinatorClient(server.address, retry_for=0.5, call_timeout=2.0, security=_security(pki, "admin")) as c:
            with pytest.raises(Exception, match="UNAVAILABLE|failed"):
                c.jobs()
        with CoordinatorClient(server.address, retry_for=5.0, security=_security(pki, "admin", cert=True)) as c:
            assert c.jobs() == []
        # The probe: health needs no credential, but under mutual TLS it needs a certificate.
        out = subprocess.run([sys.executable, "-m", "croupier.tools.cli", "health", "--address", server.address],
                             capture_output=True, text=True, timeout=60,
                             env={"CROUPIER_TLS_CA": str(pki / "ca.pem"), "CROUPIER_TLS_CERT": str(pki / "client.pem"),
                                  "CROUPIER_TLS_KEY": str(pki / "client.key"), "PATH": "/usr/bin:/bin"})
        assert out.returncode == 0 and "SERVING" in out.stdout, out.stderr
        refused = subprocess.run([sys.executable, "-m", "croupier.tools.cli", "health", "--address", server.address,
                                  "--timeout", "3"], capture_output=True, text=True, timeout=60,
                                 env={"CROUPIER_TLS_CA": str(pki / "ca.pem"), "PATH": "/usr/bin:/bin"})
        assert refused.returncode != 0, refused.stdout
        creds = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes(),
                                             private_key=(pki / "client.key").read_bytes(),
                                             certificate_chain=(pki / "client.pem").read_bytes())
        with grpc.secure_channel(server.address, creds) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING


def test_an_embedded_coordinator_of_several_ranks_wants_its_secret(tmp_path: pathlib.Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from croupier.client import _resolve

    monkeypatch.setenv("CROUPIER_STATE_DIR", str(tmp_path))
    address, secret = _resolve._start_embedded(f"sqlite:///{tmp_path}/e.db", "127.0.0.1", "job-e")
    assert secret and len(secret) >= 32
    with CoordinatorClient(address, retry_for=1.0, security=Security()) as c:
        with pytest.raises(PermissionError, match="needs a credential"):
            c.join(JoinRequest("job-e", SPEC, "x", 1, 0), wait_s=0)
    with CoordinatorClient(address, retry_for=5.0, security=Security(credential=secret)) as c:
        assert c.join(JoinRequest("job-e", SPEC, "x", 1, 0), wait_s=1.0).start is not None
    from croupier.client import _embedded

    _embedded.stop(f"sqlite:///{tmp_path}/e.db")
