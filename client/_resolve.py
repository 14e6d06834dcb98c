"""Resolution of a sampler's unset arguments: world and rank, job, the world's incarnation, the coordinator.

NOTE: anything every rank of a world must agree on (the incarnation, the embedded
coordinator's address) is agreed through that world's own process group: global rank 0 decides
and broadcasts. A launcher's per-process counters (torchrun's ``TORCHELASTIC_RESTART_COUNT`` is
each agent's own, and a joining agent starts at 0) cannot name a world.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook must be registered before ours)
import dataclasses
import ipaddress
import os
import pathlib
import secrets
import socket
import tempfile
import threading
import uuid
import weakref
from typing import Any, Protocol

from croupier.client import _embedded
from croupier.core import settings
from croupier.core.api import MAX_NAME, MAX_WORLD
from croupier.core.checks import check_int, check_name

#: The process that loaded this module; forked children inherit the exit hook but not its duty.
_PID = os.getpid()
#: Every sampler that has joined, so that a process whose loop stopped early exits promptly.
_live: weakref.WeakSet[Any] = weakref.WeakSet()


def track(sampler: Any) -> None:
    """Remembers a joined sampler (weakly); :func:`_shutdown` closes it when the interpreter exits."""
    _live.add(sampler)


def _shutdown() -> None:
    """At exit: stop every sampler's background leasing first, then the embedded coordinators.

    NOTE: a script that takes a few batches and ends without ``close()`` (a ``break``, a debug
    run, a notebook cell) would otherwise leave a prefetch thread leasing from a coordinator whose
    thread pool refuses new work at interpreter shutdown, and the process would hang.
    """
    if os.getpid() != _PID:
        return  # a forked child (a DataLoader worker): its copies of gRPC objects must not be touched
    for sampler in list(_live):
        sampler.close()
    _embedded.stop()


# NOTE: at interpreter exit, threading runs its own exit hooks (concurrent.futures' included,
# which makes every thread pool refuse work) before the atexit module's. A sampler's background
# leasing would then meet pools that refuse work in the middle of a lease. So _shutdown goes first
# among threading's hooks (they run last registered first, and concurrent.futures' is registered
# when it is imported, above); atexit is the fallback.
getattr(threading, "_register_atexit", atexit.register)(_shutdown)


def _dist() -> Any | None:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed support
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def _env_int(*names: str) -> tuple[str, int] | None:
    for name in names:
        v = os.environ.get(name)
        if v is not None:
            try:
                return name, int(v)
            except ValueError:
                raise ValueError(f"{name} must be an int (got {name}={v!r})") from None
    return None


def resolve_world(num_replicas: int | None, rank: int | None, group: Any | None = None) -> tuple[int, int]:
    """`num_replicas` and `rank`, each: given; else from `group` or the initialised default
    process group; else the launcher's environment (``WORLD_SIZE``/``RANK`` as torchrun,
    ``mp.spawn`` recipes and Kubeflow set them, then SLURM's ``SLURM_NTASKS``/``SLURM_PROCID``);
    else 1 and 0.

    Raises:
        ValueError: a launcher names a world of several processes but not this process's rank
            (or the reverse), or a value out of range.
    """
    dist = _dist()
    if group is not None and dist is None:
        raise ValueError("process_group= needs an initialised torch.distributed (call init_process_group first)")
    if dist is not None:
        if num_replicas is None:
            num_replicas = dist.get_world_size(group)
        if rank is None:
            rank = dist.get_rank(group)
    else:
        size = _env_int("WORLD_SIZE", "SLURM_NTASKS")
        me = _env_int("RANK", "SLURM_PROCID")
        if num_replicas is None and size is not None:
            if rank is None and me is None and size[1] > 1:
                raise ValueError(
                    f"{size[0]}={size[1]} says this is one of {size[1]} processes, but neither RANK nor SLURM_PROCID "
                    "says which: pass rank=, or initialise torch.distributed before the sampler"
                )
            num_replicas = size[1]
        if rank is None and me is not None:
            rank = me[1]
    num_replicas = 1 if num_replicas is None else num_replicas
    rank = 0 if rank is None else rank
    num_replicas = check_int("num_replicas", num_replicas, 1, MAX_WORLD + 1, ValueError)
    return num_replicas, check_int("rank", rank, 0, num_replicas, ValueError)


def dist_ready() -> bool:
    """Whether torch.distributed is initialised in this process."""
    return _dist() is not None


class JobHolder(Protocol):
    """A sampler as job resolution sees it: whether it is done with its derived job."""

    job: str

    def _done_with_job(self) -> bool:
        """It joined and its epoch is finished: a later sampler of its spec may go on with its job."""
        ...


@dataclasses.dataclass
class JobSlot:
    """One derived job name of this process and the sampler holding it (weakly)."""

    holder: weakref.ref[JobHolder]
    #: the holder joins as an incarnation it was given (``incarnation=`` or ``CROUPIER_INCARNATION``): a later
    #: sampler joining the same job as the same incarnation would be refused, so the name is its own
    fixed: bool
    #: the holder was closed
    released: bool = False
    #: set when the holder is collected: whether it was done with its job then
    done_when_collected: bool = False

    def collected(self, done: bool) -> None:
        """The holder is being collected: `done` says whether it was done with its job."""
        self.done_when_collected = done


#: Each derived job name's slots in this process: base -> its slots (slot 0 is named BASE,
#: slot i >= 1 BASE.(i+1)).
_slots: dict[str, list[JobSlot]] = {}
#: Samplers whose job a later one went on with (-> that job).
_taken_over: weakref.WeakKeyDictionary[JobHolder, str] = weakref.WeakKeyDictionary()
_slots_lock = threading.Lock()


def resolve_job(job: str | None, spec: Any, holder: JobHolder, fixed: bool) -> tuple[str, bool, JobSlot | None]:
    """The job's name, and whether it was named (``job=`` or ``CROUPIER_JOB``) rather than derived.

    A derived name is ``RUN.FINGERPRINT``: RUN is the launcher's run (``TORCHELASTIC_RUN_ID``,
    else ``SLURM_JOB_ID``, else ``local``) and FINGERPRINT the first 12 characters of the spec's
    fingerprint. Samplers of different data or settings, and different launches, never share a
    job; every rank derives the same name, since it runs the same program.

    Samplers of one spec in one process: `holder` takes the first name (``RUN.FINGERPRINT``, then
    ``.2``, ``.3``, ...) that no earlier sampler still holds. A sampler holds its name until it is
    closed or garbage-collected, or it has joined and finished its epoch: so train, val and test
    samplers made before they are iterated get names of their own, and a loop that makes a new
    sampler every epoch goes on with one job (each new sampler joins it as the next
    generation). An earlier sampler whose job a later one went on with is refused if it is
    iterated again (:func:`check_holds`).
    """
    if job is None:
        job = settings.get("CROUPIER_JOB")
    if job is not None:
        return check_name("job", job, MAX_NAME), True, None
    run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or "local"
    base = f"{run[:200]}.{spec.fingerprint[:12]}"
    slot = JobSlot(weakref.ref(holder), fixed)
    with _slots_lock:
        slots = _slots.setdefault(base, [])
        i = len(slots) if fixed else next((i for i, s in enumerate(slots) if _free(s)), len(slots))
        name = base if i == 0 else f"{base}.{i + 1}"
        if i < len(slots):
            earlier = slots[i].holder()
            if earlier is not None and not slots[i].released:
                _taken_over[earlier] = name
            slots[i] = slot
        else:
            slots.append(slot)
    return name, False, slot


def _free(slot: JobSlot) -> bool:
    """Whether `slot` may be taken (the caller holds ``_slots_lock``).

    NOTE: what decides is what the program did (closed its sampler, finished its epoch), never
    when the garbage collector ran: a holder collected says what it was when it went
    (:meth:`JobSlot.collected`), which is what it would say alive, since nothing used it since.
    Every rank of a job runs the same program, so every rank derives the same names.
    """
    if slot.fixed:
        return False
    if slot.released:
        return True
    holder = slot.holder()
    return slot.done_when_collected if holder is None else holder._done_with_job()


def release(slot: JobSlot | None) -> None:
    """The sampler holding `slot` is closed: its derived job's name is free for the next sampler of its spec."""
    if slot is not None:
        with _slots_lock:
            slot.released = True


def check_holds(holder: JobHolder) -> None:
    """Raises RuntimeError if a later sampler of `holder`'s spec went on with its derived job.

    NOTE: the later sampler's join opened a new generation of the job, which fences this one;
    without this check its next lease would be refused as a zombie's, which it is not.
    """
    with _slots_lock:
        name = _taken_over.get(holder)
    if name is not None and name == holder.job:
        raise RuntimeError(
            f"job {name!r} was taken over by a sampler of the same spec made in this process after this one "
            "finished its epoch (a loop that makes a new sampler every epoch goes on with one job): to use "
            "both, pass job= to each, or make both before iterating either"
        )


def _store_dir() -> pathlib.Path:
    return pathlib.Path(settings.get("CROUPIER_STATE_DIR") or pathlib.Path(tempfile.gettempdir()) / "croupier")


def _reachable_host() -> str:
    """The address of this machine that the job's other nodes reach it by.

    All ranks on one machine (``LOCAL_WORLD_SIZE`` equals ``WORLD_SIZE``, one SLURM node, or a
    loopback ``MASTER_ADDR``): loopback. Otherwise the local address of the interface that routes
    to the job's ``MASTER_ADDR`` (no packet is sent), else the host name's address. A launcher
    that sets none of these on several machines: set ``CROUPIER_ADDRESS``.
    """
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    master = os.environ.get("MASTER_ADDR")
    if (local is not None and local == world) or os.environ.get("SLURM_NNODES") == "1" or _is_loopback(master):
        return "127.0.0.1"
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, int(os.environ.get("MASTER_PORT", "1"))))
                return str(s.getsockname()[0])
        except OSError:
            pass
    return socket.gethostbyname(socket.getfqdn())


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def agree(incarnation: str | None, address: str | None, job: str, num_replicas: int) -> tuple[str, str, str | None]:
    """The incarnation, the coordinator address and the embedded coordinator's secret (or
    None), the same on every rank of this world.

    Each is: given; else ``CROUPIER_INCARNATION`` (or its old name ``CROUPIER_TOKEN``) /
    ``CROUPIER_ADDRESS``; else decided by global rank 0
    and broadcast over the default process group (a fresh random incarnation; an embedded
    coordinator that rank 0 hosts, its store a SQLite file under ``CROUPIER_STATE_DIR``, default
    ``$TMPDIR/croupier``). A process alone in its job decides both itself (the embedded
    coordinator then keeps its store in memory: the checkpoint state is enough to resume).

    The embedded coordinator of a job of several processes takes calls only with a random secret
    that rank 0 makes when it starts it, and hands to the other ranks in the same broadcast (over
    the job's own process group): the port may be reachable from other hosts, and nobody else
    can join the job or fence it. A job of one process binds loopback and needs none.

    NOTE: the broadcast is a collective: every process of the job must reach its sampler's first
    batch, as a data-parallel loop does. It runs once per sampler, at the first batch.

    Raises:
        ValueError: several ranks, no process group, and the incarnation or address not given.
    """
    incarnation = incarnation or settings.get("CROUPIER_INCARNATION")
    address = address or settings.get("CROUPIER_ADDRESS")
    if incarnation and address:
        return incarnation, address, None
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        if num_replicas > 1:
            raise ValueError(
                f"job {job!r} has {num_replicas} ranks but no initialised torch.distributed to agree on their "
                "incarnation: call init_process_group before the first batch, or set CROUPIER_INCARNATION (the same on every "
                "rank, new at every restart) and CROUPIER_ADDRESS"
            )
        return incarnation or uuid.uuid4().hex, address or _start_embedded("memory://", "127.0.0.1")[0], None
    decided: list[Any] = [None, None, None]
    if dist.get_rank() == 0:
        decided = [incarnation or uuid.uuid4().hex, address, None]
        if address is None:
            db = _store_dir() / f"{_safe(job)}.db"
            decided[1], decided[2] = _start_embedded(f"sqlite:///{db}", _reachable_host(), job)
    dist.broadcast_object_list(decided, src=0)
    return str(decided[0]), str(decided[1]), decided[2]


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def embedded_here(address: str) -> bool:
    """Whether `address` is a coordinator that this process started for its job (and still serves)."""
    return _embedded.serving(address)


def _start_embedded(store_url: str, host: str, job: str | None = None) -> tuple[str, str | None]:
    """Starts (once per process and store) a coordinator for this process, in a process of its own
    (``_embedded``); returns its address and, for a job's coordinator (`job` given), the secret that the
    job's ranks call it with."""
    secret = secrets.token_urlsafe(32) if job is not None else None
    return _embedded.start(store_url, host, f"job {job}", secret)


def local_world_size() -> int:
    """The ranks of this node: torchrun's ``LOCAL_WORLD_SIZE``, else 1 (a shard order's default reader group)."""
    got = _env_int("LOCAL_WORLD_SIZE")
    if got is None:
        return 1
    return check_int("LOCAL_WORLD_SIZE", got[1], 1)
