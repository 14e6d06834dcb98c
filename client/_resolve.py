"""Resolution of a sampler's unset arguments from the environment, and the embedded coordinator."""

from __future__ import annotations

import atexit
import os
import pathlib
import socket
import tempfile
import threading
import uuid
from datetime import timedelta
from typing import Any

from croupier.core.api import MAX_WORLD
from croupier.core.checks import check_int

_KEY = "croupier"
_embedded: dict[str, Any] = {}
_embedded_lock = threading.Lock()


def _dist() -> Any | None:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed support
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def resolve_world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """`num_replicas` and `rank`: given, else from torch.distributed, else WORLD_SIZE / RANK, else 1 / 0."""
    dist = _dist()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if dist else int(os.environ.get("WORLD_SIZE", "1"))
    if rank is None:
        rank = dist.get_rank() if dist else int(os.environ.get("RANK", "0"))
    num_replicas = check_int("num_replicas", num_replicas, 1, MAX_WORLD + 1, ValueError)
    return num_replicas, check_int("rank", rank, 0, num_replicas, ValueError)


def resolve_job(job: str | None) -> str:
    """`job`: given, else CROUPIER_JOB, else TORCHELASTIC_RUN_ID, else "default"."""
    job = job or os.environ.get("CROUPIER_JOB") or os.environ.get("TORCHELASTIC_RUN_ID") or "default"
    if not isinstance(job, str) or len(job) > 256:
        raise ValueError(f"job must be a string of at most 256 characters (got job={job!r})")
    return job


def _agent_store() -> Any | None:
    """The c10d store of a torchrun job: torch.distributed's, or the agent's at MASTER_ADDR:MASTER_PORT."""
    dist = _dist()
    if dist is not None:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    if "TORCHELASTIC_RUN_ID" in os.environ and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]  # exported at run time

        return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                        timeout=timedelta(seconds=300))
    return None


def resolve_token(token: str | None, job: str, world: int, rank: int) -> str:
    """The incarnation token shared by the ranks of this world (see JoinRequest.token).

    NOTE: a torchrun restart count alone is not enough (a job launched again starts counting
    from 0), so one process per incarnation draws a random nonce and the others read it from
    the job's c10d store (torch.distributed's, or torchrun's agent store).
    """
    if token:
        return token
    env = os.environ.get("CROUPIER_TOKEN")
    if env:
        return env
    if world == 1:
        return uuid.uuid4().hex
    store = _agent_store()
    if store is None:
        raise ValueError(
            f"cannot tell which incarnation of job {job!r} this rank {rank} of {world} belongs to: run under "
            "torchrun or an initialised torch.distributed, or set CROUPIER_TOKEN (the same value on every rank, "
            "a new value at every restart)"
        )
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"{_KEY}/{job}/token/{restart}"
    mine = f"{restart}-{uuid.uuid4().hex}"
    return bytes(store.compare_set(key, "", mine)).decode()


def _store_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("CROUPIER_STATE_DIR") or pathlib.Path(tempfile.gettempdir()) / "croupier")


def resolve_address(address: str | None, job: str, world: int, rank: int, token: str) -> str:
    """`address`: given, else CROUPIER_ADDRESS, else an embedded coordinator.

    The embedded coordinator runs in this process when the world is one process; in a torchrun
    job, rank 0 runs it (its store a SQLite file under CROUPIER_STATE_DIR, default
    $TMPDIR/croupier) and publishes its address in the job's c10d store, where the others read it.
    """
    if address:
        return address
    env = os.environ.get("CROUPIER_ADDRESS")
    if env:
        return env
    if world == 1:
        return _start_embedded("memory://", "127.0.0.1")
    store = _agent_store()
    if store is None:
        raise ValueError(
            f"rank {rank} of {world} has no coordinator address: set CROUPIER_ADDRESS, pass address=, or run "
            "under torchrun / torch.distributed so that rank 0 can host the embedded coordinator"
        )
    key = f"{_KEY}/{job}/address/{token}"
    if rank == 0:
        one_host = os.environ.get("LOCAL_WORLD_SIZE", str(world)) == str(world)
        host = "127.0.0.1" if one_host else "0.0.0.0"
        db = _store_dir() / f"{job}.db"
        addr = _start_embedded(f"sqlite:///{db}", host)
        if not one_host:
            addr = f"{socket.getfqdn()}:{addr.rsplit(':', 1)[1]}"
        store.set(key, addr)
        return addr
    store.wait([key], timedelta(seconds=300))
    return bytes(store.get(key)).decode()


def _start_embedded(store_url: str, host: str) -> str:
    """Starts (once per process and store) a coordinator in this process; returns its address."""
    with _embedded_lock:
        server = _embedded.get(store_url)
        if server is None:
            from croupier.server import Server

            server = Server(store_url, host=host, port=0).start()
            _embedded[store_url] = server
            atexit.register(server.stop, 0.5)
        return f"127.0.0.1:{server.port}" if host in ("127.0.0.1", "0.0.0.0") else server.address
