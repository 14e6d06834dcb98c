"""Every ``CROUPIER_*`` environment variable croupier reads: one table, read here and nowhere else.

The docs list the same table (docs/settings.md); tests/core/test_settings.py keeps the two in step and
fails on a read of a ``CROUPIER_*`` variable outside this module. An explicit argument always wins
over its variable; an empty variable counts as unset.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Setting:
    """One environment variable: its name, its default when unset, and what it sets."""

    name: str
    default: str | None
    meaning: str
    #: the variable's old name, read when this one is unset
    old: str | None = None


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("CROUPIER_ADDRESS", None, "HOST:PORT (or several, comma-separated replicas) of the coordinator the "
            "samplers and `croupier status` / `croupier health` call; unset: samplers start an embedded one"),
    Setting("CROUPIER_JOB", None, "the job's name, when a sampler is given no `job=`"),
    Setting("CROUPIER_RUN", None, "names this start of a fault-tolerant (torchft) job, when its `StepLoader` is "
            "given no `run=` (default: derived from the checkpoint state it loaded)"),
    Setting("CROUPIER_INCARNATION", None, "names the incarnation of the job's world, when a sampler is given no "
            "`incarnation=` (default: from torchrun / torch.distributed)", old="CROUPIER_TOKEN"),
    Setting("CROUPIER_TOKEN", None, "the old name of `CROUPIER_INCARNATION`, read when that is unset"),
    Setting("CROUPIER_STATE_DIR", None, "where the embedded coordinator keeps its store (default: the system's "
            "temporary directory, under croupier/)"),
    Setting("CROUPIER_AUDIT_DIR", None, "where samplers write their audit logs, when given no `audit_dir=` "
            "(unset: no audit log)"),
    Setting("CROUPIER_JOIN_TIMEOUT", "600", "seconds a sampler's first batch waits for the other ranks of its "
            "generation, when given no `join_timeout=`"),
    Setting("CROUPIER_EXPANDER", "1", "`0` computes every lease's indices in the training process instead of "
            "in the lease helper process"),
    Setting("CROUPIER_TLS", None, "`1`, `true` or `yes`: reach the coordinator over TLS with the system's roots"),
    Setting("CROUPIER_TLS_CA", None, "a PEM file of the roots that sign the coordinator's certificate (implies TLS)"),
    Setting("CROUPIER_TLS_CERT", None, "the client's certificate (PEM) for mutual TLS; needs CROUPIER_TLS_KEY"),
    Setting("CROUPIER_TLS_KEY", None, "the client certificate's private key (PEM)"),
    Setting("CROUPIER_TLS_SERVER_NAME", None, "the name the coordinator's certificate must carry, when it is "
            "not the address's host (implies TLS)"),
    Setting("CROUPIER_CREDENTIAL", None, "the job's credential, sent with every call to a coordinator that "
            "checks credentials (`croupier serve --credentials`)"),
    Setting("CROUPIER_CALL_LOG", None, "a directory: every client records its Join, Grant, Lease and checkpoint "
            "calls there with their times, for `croupier.harness.linearize` (unset: no record)"),
    Setting("CROUPIER_STORE", "sqlite:///croupier.db", "the store `croupier serve` opens when given no "
            "`--store` (keeps a database password out of the command line)"),
    Setting("CROUPIER_DEMO_NODE", None, "set by `croupier demo` for its trainers: the name of the node a trainer "
            "runs on (for its log lines)"),
)}


def get(name: str) -> str | None:
    """The variable's value, else its old name's, else its default (None when it has none); an
    empty value counts as unset.

    Raises:
        KeyError: `name` is not one of :data:`SETTINGS` (a variable croupier does not read).
    """
    setting = SETTINGS[name]
    value = os.environ.get(name) or (os.environ.get(setting.old) if setting.old else None)
    return value if value else setting.default


def get_float(name: str) -> float:
    """The variable as a number of seconds; ValueError names the variable and its value otherwise."""
    value = get(name)
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number (got {name}={value!r})") from None


def flag(name: str) -> bool:
    """The variable as a switch: true for ``1``, ``true`` or ``yes`` (any case)."""
    return (get(name) or "").strip().lower() in ("1", "true", "yes")


#: Where the command-line tools find a coordinator when neither ``--address`` nor ``CROUPIER_ADDRESS`` names one.
DEFAULT_ADDRESS = "127.0.0.1:50051"


def coordinator_address(address: str | None) -> str:
    """The coordinator a tool talks to: `address` if given, else ``CROUPIER_ADDRESS``, else :data:`DEFAULT_ADDRESS`."""
    return address or get("CROUPIER_ADDRESS") or DEFAULT_ADDRESS
