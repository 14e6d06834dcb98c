"""Per-job credentials: who may call which RPC for which jobs.

A caller presents a secret in the gRPC metadata ``authorization: Bearer <secret>`` (the client
reads it from ``CROUPIER_CREDENTIAL``). The server maps it to a credential of the credentials
file, a JSON document::

    {"credentials": [
      {"name": "team-a", "sha256": "<hex SHA-256 of the secret>", "role": "train", "jobs": ["team-a/*"]},
      {"name": "dashboards", "secret": "<the secret itself>", "role": "read"},
      {"name": "ops", "sha256": "...", "role": "admin"}
    ]}

- ``name`` names the credential in errors and logs (the secret never appears in either).
- ``sha256`` (preferred: the file then holds no secret) or ``secret``.
- ``role``: ``read`` may call GetJob, GetCheckpoint, ListJobs and GetLedger; ``train`` also Join, Lease,
  Grant, Report and Amend (a trainer skips the samples it finds corrupt); ``admin`` may call everything, for every job.
- ``jobs``: shell-style patterns (``fnmatch``, case-sensitive) of the job names the credential
  may use; default ``["*"]``. ListJobs lists only the jobs a credential may read.

No credential, or one the file does not hold: UNAUTHENTICATED. A credential for another job, or
a role below the call's: PERMISSION_DENIED. Either way the call changes nothing. The health and
reflection services need no credential (probes); with mutual TLS they still need a certificate.
The HTTP endpoint (``croupier.server._http``) takes the same credentials, as ``Authorization: Bearer <secret>``,
each endpoint needing the role of the RPC that shows the same data.

Secrets are compared as SHA-256 digests with ``hmac.compare_digest`` against every credential
in turn (no early exit). The file is read again on SIGHUP (``croupier serve``) and when its
modification time or size changes (checked at most once a second, by the calls); a file that no
longer parses keeps the credentials in force and logs why.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import hmac
import json
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from croupier.core import errors as E
from croupier.core.checks import check_choice, check_type

log = logging.getLogger("croupier.server")

#: Roles in increasing power; each may do what the ones before it may.
ROLES = ("read", "train", "admin")
#: The least role each RPC needs.
NEEDS = {"GetJob": "read", "GetCheckpoint": "read", "ListJobs": "read", "GetLedger": "read",
         "Join": "train", "Lease": "train", "Grant": "train", "Report": "train", "Amend": "train",
         "CommitStep": "train"}
METADATA_KEY = "authorization"
_SCHEME = "Bearer "


@dataclasses.dataclass(frozen=True)
class Credential:
    """One entry of the credentials file."""

    name: str
    digest: bytes  # SHA-256 of the secret
    role: str
    jobs: tuple[str, ...] = ("*",)

    def may(self, role: str, job: str | None) -> bool:
        """Whether this credential has `role` (or more) for `job` (None: no job in particular)."""
        if ROLES.index(self.role) < ROLES.index(role):
            return False
        return self.role == "admin" or job is None or self.reads(job)

    def reads(self, job: str) -> bool:
        return self.role == "admin" or any(fnmatch.fnmatchcase(job, p) for p in self.jobs)


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def parse(doc: Any, where: str) -> tuple[Credential, ...]:
    """The credentials of a decoded credentials document; ValueError names what is wrong (never a secret)."""
    if not isinstance(doc, Mapping) or set(doc) != {"credentials"} or not isinstance(doc["credentials"], list):
        raise ValueError(f"{where}: the document must be {{\"credentials\": [...]}}")
    out: list[Credential] = []
    names: set[str] = set()
    for i, entry in enumerate(doc["credentials"]):
        at = f"{where}: credential {i}"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{at} must be an object")
        unknown = sorted(set(entry) - {"name", "sha256", "secret", "role", "jobs"})
        if unknown:
            raise ValueError(f"{at} has unknown fields {unknown}")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{at} needs a non-empty name")
        at = f"{where}: credential {name!r}"
        if name in names:
            raise ValueError(f"{at} appears twice")
        names.add(name)
        if ("sha256" in entry) == ("secret" in entry):
            raise ValueError(f"{at} needs exactly one of sha256 and secret")
        if "secret" in entry:
            if len(check_type(f"{at}: secret", entry["secret"], str, ValueError)) < 16:
                raise ValueError(f"{at}: secret must be a string of at least 16 characters")
            d = digest(entry["secret"])
        else:
            h = entry["sha256"]
            try:
                d = bytes.fromhex(h) if isinstance(h, str) else b""
            except ValueError:
                d = b""
            if len(d) != 32:
                raise ValueError(f"{at}: sha256 must be 64 hex digits")
        try:
            role = check_choice("role", entry.get("role"), ROLES)
        except ValueError as e:
            raise ValueError(f"{at}: {e}") from None
        jobs = entry.get("jobs", ["*"])
        if not isinstance(jobs, list) or not jobs or not all(isinstance(p, str) and p for p in jobs):
            raise ValueError(f"{at}: jobs must be a non-empty list of patterns")
        out.append(Credential(name, d, role, tuple(jobs)))
    return tuple(out)


class Authorizer:
    """Checks every call's credential against the credentials in force."""

    def __init__(self, credentials: Sequence[Credential] = (), path: str | None = None) -> None:
        """Args:
            credentials: Credentials in force (an embedded coordinator passes its one).
            path: A credentials file to read now and again on change (see the module docstring).

        Raises:
            ValueError: the file does not parse (the server does not start).
            OSError: the file cannot be read.
        """
        self._lock = threading.Lock()
        self._path = path
        self._credentials = tuple(credentials)
        self._stamp: tuple[float, int] | None = None
        self._checked = 0.0
        if path is not None:
            self._credentials = self._read()

    @classmethod
    def of_secret(cls, name: str, secret: str, role: str = "admin", jobs: Sequence[str] = ("*",)) -> Authorizer:
        """An authorizer of one credential, with no file."""
        return cls([Credential(name, digest(secret), role, tuple(jobs))])

    def _read(self) -> tuple[Credential, ...]:
        assert self._path is not None
        st = os.stat(self._path)
        with open(self._path, encoding="utf-8") as f:
            try:
                doc = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{self._path}: not JSON ({e.msg} at line {e.lineno})") from None
        creds = parse(doc, self._path)
        self._stamp = (st.st_mtime, st.st_size)
        return creds

    def reload(self) -> bool:
        """Reads the file again; on error keeps the credentials in force. Returns whether it loaded."""
        if self._path is None:
            return False
        with self._lock:
            try:
                self._credentials = self._read()
            except (OSError, ValueError) as e:
                log.error("credentials file not reloaded, the previous credentials stay in force: %s", e)
                return False
        log.info("credentials reloaded from %s: %d credentials", self._path, len(self._credentials))
        return True

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if self._path is None or now - self._checked < 1.0:
            return
        self._checked = now
        try:
            st = os.stat(self._path)
        except OSError:
            return
        if (st.st_mtime, st.st_size) != self._stamp:
            self.reload()

    def identify(self, context: grpc.ServicerContext) -> Credential:
        """The caller's credential; UNAUTHENTICATED when it has none or one not in force."""
        secret = None
        for key, value in context.invocation_metadata():
            if key == METADATA_KEY and isinstance(value, str) and value.startswith(_SCHEME):
                secret = value[len(_SCHEME):]
        if not secret:
            raise E.Unauthenticated(
                f"this coordinator needs a credential: send metadata '{METADATA_KEY}: Bearer <secret>' "
                "(croupier's client sends CROUPIER_CREDENTIAL)"
            )
        found = self.known(secret)
        if found is None:
            raise E.Unauthenticated("the credential is not one this coordinator knows")
        return found

    def known(self, secret: str) -> Credential | None:
        """The credential in force whose secret is `secret`, or None (the gRPC calls and the HTTP endpoint ask it)."""
        self._maybe_reload()
        d = digest(secret)
        found = None
        for c in self._credentials:  # every one, whatever matched: the time does not depend on which
            if hmac.compare_digest(c.digest, d):
                found = c
        return found

    def check(self, context: grpc.ServicerContext, method: str, job: str | None) -> Credential:
        """The caller's credential, after checking it may call `method` for `job`."""
        cred = self.identify(context)
        allow(cred, method, job)
        return cred


def allow(cred: Credential, method: str, job: str | None) -> None:
    """PERMISSION_DENIED unless `cred` may call `method` for `job`."""
    need = NEEDS[method]
    if not cred.may(need, job):
        what = f"job {job!r}" if job is not None else "this call"
        if ROLES.index(cred.role) < ROLES.index(need):
            why = f"{method} needs role {need!r} and it has {cred.role!r}"
        else:
            why = f"its jobs are {list(cred.jobs)}"
        raise E.PermissionDenied(f"credential {cred.name!r} may not call {method} for {what}: {why}")
