"""The HTTP endpoint behind the gRPC side's door, over a real server: every endpoint x every kind of caller (the
same credentials file and roles), TLS and mutual TLS with the gRPC port's certificate, /healthz open for probes,
Prometheus's bearer scrape, and refusals that say why and change nothing."""

from __future__ import annotations

import http.client
import json
import logging
import pathlib
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from _ledger_run import JOB, SPEC, run
from _pki import make_pki
from prometheus_client.parser import text_string_to_metric_families

from croupier.core.api import JoinRequest
from croupier.server import Server, ServerOptions, _auth
from croupier.server._auth import digest

OTHER = "other-a"  # a second job, of another team
SECRETS = {"ops": "ops-secret-0123456789", "team": "team-secret-0123456789", "dash": "dash-secret-0123456789",
           "other": "other-secret-0123456789"}
CREDENTIALS = {"credentials": [
    {"name": "ops", "sha256": digest(SECRETS["ops"]).hex(), "role": "admin"},
    {"name": "team", "sha256": digest(SECRETS["team"]).hex(), "role": "train", "jobs": [JOB]},
    {"name": "dash", "secret": SECRETS["dash"], "role": "read", "jobs": [JOB]},
    {"name": "other", "sha256": digest(SECRETS["other"]).hex(), "role": "read", "jobs": ["other*"]},
]}
JOBS_OF = {c["name"]: c.get("jobs", ["*"]) for c in CREDENTIALS["credentials"]}
#: Each caller's Authorization header (None: none sent).
HEADERS = {"none": None, "unknown": "Bearer not-a-known-secret-at-all", "basic": "Basic " + SECRETS["ops"],
           **{who: f"Bearer {s}" for who, s in SECRETS.items()}}
ABOUT_JOB = (f"/api/ledger?job={JOB}", f"/api/mix?job={JOB}", f"/api/step?job={JOB}&step=12&samples=1")
ABOUT_OTHER = (f"/api/ledger?job={OTHER}", f"/api/mix?job={OTHER}")
LISTS = ("/metrics", "/api/jobs?limit=10")
OPEN = ("/", "/healthz")


def expected(caller: str, path: str) -> int:
    """The status each caller gets: 401 without a known bearer credential, 403 for a job it may not read."""
    if path in OPEN:
        return 200
    if caller in ("none", "unknown", "basic"):
        return 401
    if path in ABOUT_JOB and caller == "other":
        return 403
    if path in ABOUT_OTHER:
        return 403 if caller in ("dash", "team") else 200
    return 200


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A CA, a server certificate for localhost / 127.0.0.1 and a client certificate (tests/_pki.py)."""
    return make_pki(tmp_path_factory.mktemp("pki"))


def _serve(tmp_path: pathlib.Path, **options: object) -> Server:
    creds = tmp_path / "credentials.json"
    creds.write_text(json.dumps(CREDENTIALS))
    opts = ServerOptions(metrics_port=0, auth_file=str(creds), **options)  # type: ignore[arg-type]
    s = Server(f"sqlite:///{tmp_path}/c.db", options=opts).start()
    run(s.core)
    s.core.join(JoinRequest(OTHER, SPEC, "a", 1, 0))
    return s


@pytest.fixture
def server(tmp_path: pathlib.Path) -> Iterator[Server]:
    s = _serve(tmp_path)
    try:
        yield s
    finally:
        s.stop(grace=0.5)


def get(url: str, header: str | None = None, context: ssl.SSLContext | None = None) -> tuple[int, dict[str, str], str]:
    req = urllib.request.Request(url, headers={} if header is None else {"Authorization": header})
    try:
        with urllib.request.urlopen(req, timeout=30, context=context) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def test_every_endpoint_for_every_caller(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    """The matrix; a refusal names the endpoint, the role and the job, holds no secret and changes nothing."""
    caplog.set_level(logging.DEBUG, logger="croupier")
    base = f"http://{server.metrics_address}"
    before = server.core.snapshot_state()
    for caller, header in HEADERS.items():
        for path in (*OPEN, *LISTS, *ABOUT_JOB, *ABOUT_OTHER):
            status, headers, body = get(base + path, header)
            assert status == expected(caller, path), (caller, path, status, body)
            assert all(s not in body for s in SECRETS.values()), (caller, path)
            endpoint = path.partition("?")[0]
            if status == 401:
                assert headers["WWW-Authenticate"].startswith("Bearer")
                assert f"{endpoint} needs a credential with role 'read'" in body, body
                why = "not one this coordinator knows" if caller == "unknown" else "'Authorization: Bearer <secret>'"
                assert why in body, body
            if status == 403:
                job = OTHER if OTHER in path else JOB
                assert body == (f"{endpoint} needs a credential with role 'read' or more for job {job!r}: credential "
                                f"{caller!r} may not read it: its jobs are {JOBS_OF[caller]}\n"), body
    assert server.core.snapshot_state() == before
    assert not any(s in r.getMessage() for r in caplog.records for s in SECRETS.values()), "a secret in the log"


def test_a_credential_sees_the_jobs_it_may_read(server: Server) -> None:
    """/api/jobs and /metrics list only the credential's jobs, as ListJobs does; admin sees every one."""
    base = f"http://{server.metrics_address}"
    for caller, jobs in (("dash", [JOB]), ("other", [OTHER]), ("ops", sorted([JOB, OTHER])), ("team", [JOB])):
        status, _, body = get(f"{base}/api/jobs", HEADERS[caller])
        page = json.loads(body)
        assert status == 200 and [j["name"] for j in page["jobs"]] == jobs and page["total"] == len(jobs), (caller, page)
        status, _, text = get(f"{base}/metrics", HEADERS[caller])
        labelled = {s.labels["job"] for f in text_string_to_metric_families(text) for s in f.samples if "job" in s.labels}
        assert status == 200 and labelled == set(jobs), (caller, labelled)
        assert "croupier_rpc_calls_total" in text  # the server's own series, which name no job
    status, _, body = get(f"{base}/api/step?job={JOB}&step=12&samples=1", HEADERS["dash"])
    assert status == 200 and json.loads(body)["step"] == 12  # the step's indices, to a read credential of the job


def test_the_endpoints_move_with_the_rpc_that_shows_the_same_data(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ledger's endpoints need GetLedger's role: raised to train, a read credential is refused naming both roles."""
    monkeypatch.setitem(_auth.NEEDS, "GetLedger", "train")
    base = f"http://{server.metrics_address}"
    status, _, body = get(f"{base}/api/step?job={JOB}&step=12", HEADERS["dash"])
    assert (status, body) == (403, f"/api/step needs a credential with role 'train' or more for job {JOB!r}: "
                                   "credential 'dash' may not read it: it has role 'read'\n")
    assert get(f"{base}/api/step?job={JOB}&step=12", HEADERS["team"])[0] == 200
    assert get(f"{base}/api/jobs", HEADERS["dash"])[0] == 200  # progress stays the read role's


def test_prometheus_scrapes_with_a_bearer_credential(server: Server) -> None:
    """As Prometheus's ``authorization: {type: Bearer, credentials_file: ...}`` sends it."""
    base = f"http://{server.metrics_address}"
    assert get(f"{base}/metrics")[0] == 401
    status, headers, text = get(f"{base}/metrics", f"bearer  {SECRETS['dash']} ")  # the scheme in any case
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    families = {f.name for f in text_string_to_metric_families(text)}
    assert {"croupier_job_generation", "croupier_rpc_calls", "croupier_coordinator_failed"} <= families


def test_the_endpoint_speaks_tls_with_the_servers_certificate(tmp_path: pathlib.Path, pki: pathlib.Path) -> None:
    s = _serve(tmp_path, tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"))
    try:
        ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        base = f"https://{s.metrics_address}"
        assert get(f"{base}/healthz", context=ctx)[:3:2] == (200, "ok\n")  # probes: no credential
        assert get(f"{base}/api/step?job={JOB}&step=12", context=ctx)[0] == 401
        status, _, body = get(f"{base}/api/step?job={JOB}&step=12&samples=1", HEADERS["dash"], context=ctx)
        assert status == 200 and json.loads(body)["step"] == 12
        with pytest.raises((urllib.error.URLError, http.client.HTTPException, ConnectionError)):
            get(f"http://{s.metrics_address}/healthz")  # plain HTTP is not spoken
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            get(f"{base}/healthz", context=ssl.create_default_context())  # the server's certificate is the gRPC port's
    finally:
        s.stop(grace=0.5)


def test_mutual_tls_wants_a_client_certificate(tmp_path: pathlib.Path, pki: pathlib.Path) -> None:
    s = _serve(tmp_path, tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"), tls_client_ca=str(pki / "ca.pem"))
    try:
        base = f"https://{s.metrics_address}"
        with pytest.raises((urllib.error.URLError, http.client.HTTPException, ConnectionError, ssl.SSLError)):
            get(f"{base}/healthz", context=ssl.create_default_context(cafile=str(pki / "ca.pem")))
        ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        ctx.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
        assert get(f"{base}/healthz", context=ctx)[0] == 200
        assert get(f"{base}/metrics", HEADERS["ops"], context=ctx)[0] == 200
    finally:
        s.stop(grace=0.5)


def test_with_no_credentials_file_the_endpoint_stays_open(tmp_path: pathlib.Path) -> None:
    with Server(f"sqlite:///{tmp_path}/c.db", options=ServerOptions(metrics_port=0)) as s:
        run(s.core)
        base = f"http://{s.metrics_address}"
        for path in (*OPEN, *LISTS, *ABOUT_JOB):
            assert get(base + path)[0] == 200, path
