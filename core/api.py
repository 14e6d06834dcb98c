"""What a rank and the coordinator say to each other, as domain types, and the limits of one call.

Both sides use these: the client builds a :class:`JoinRequest`, the wire converts it, the
coordinator validates and decides on it. Nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from croupier.core.amend import Amendment
from croupier.core.checks import check_int, check_name
from croupier.core.cursor import Cursor, validate_cursor
from croupier.core.errors import InvalidArgument
from croupier.core.plan import Grant
from croupier.core.schedule import Schedule
from croupier.core.spec import Spec

__all__ = [
    "CHECKPOINT_HISTORY", "MAX_COUNT", "MAX_JOIN_WAIT_S", "MAX_LEASE_BATCHES", "MAX_LEASE_INDICES", "MAX_MESSAGE_BYTES",
    "MAX_NAME", "MAX_WORLD", "CheckpointRecord", "Grant", "JobStatus", "JoinRequest", "JoinResult", "Lease", "RankCursor",
    "now_ms", "validate_join",
]

#: The largest world a generation may have.
MAX_WORLD = 1 << 20
#: The longest job name or incarnation.
MAX_NAME = 256
#: The most batches one lease may ask for, and the most indices it may return.
MAX_LEASE_BATCHES = 1 << 16
MAX_LEASE_INDICES = 1 << 24
#: How long one join call may wait for the other ranks of its generation, at most.
MAX_JOIN_WAIT_S = 30.0
#: Epochs, batches and generations are below this.
MAX_COUNT = 2**62
#: The largest message either end sends or receives (a join carries the spec's lengths: 8 bytes a sample).
MAX_MESSAGE_BYTES = 256 << 20


def now_ms() -> int:
    """Unix time in milliseconds: the clock of the times reports and checkpoints carry, and of their ages."""
    return int(time.time() * 1000)


@dataclasses.dataclass(frozen=True)
class JoinRequest:
    """A rank of a (new) generation announcing itself.

    Attributes:
        job: The job's name.
        spec: The job's spec; MUST equal the spec the job was registered with.
        incarnation: Names the incarnation of the job's world this rank belongs to (e.g.
            torchrun's run id and restart count). An incarnation not seen before opens a new
            generation and fences the old one; one of an older generation is refused.
        world: World size of the generation.
        rank: This rank, in [0, world).
        resume: The cursor from the checkpoint state this rank loaded, or None.
        epoch: The epoch given to ``set_epoch`` before the first batch, or None.
        amendments: The amendments of the checkpoint state this rank loaded (each with its
            position), in order; a job that lost its store takes them back from it.
        resume_step: The trainer's step at the checkpoint state this rank loaded, if it named one.
        resume_generation: The generation that took that state, if it names one.
        schedule: The trainer's step schedule (``croupier.core.schedule``); every rank of a
            generation MUST send the same.
    """

    job: str
    spec: Spec
    incarnation: str
    world: int
    rank: int
    resume: Cursor | None = None
    epoch: int | None = None
    amendments: tuple[Amendment, ...] = ()
    resume_step: int | None = None
    resume_generation: int | None = None
    schedule: Schedule = Schedule()


@dataclasses.dataclass(frozen=True)
class JoinResult:
    """Where a joined rank stands: its generation, and the resume point once every rank is in.

    Attributes:
        amendments: The amendments the generation deals with, each with its position (complete
            once it started).
        spec: The job's spec, when it differs from the rank's own (a source grown: the rank may
            send the sizes it has now); None when the rank's is the job's.
        waiting: How many ranks the generation waits for; ``waiting_for`` names the first of them
            (at most 16). None: as many as ``waiting_for`` names.
    """

    generation: int
    world: int
    start: Cursor | None
    waiting_for: tuple[int, ...]
    amendments: tuple[Amendment, ...] = ()
    spec: Spec | None = None
    waiting: int | None = None

    @property
    def waiting_count(self) -> int:
        """How many ranks the generation waits for."""
        return len(self.waiting_for) if self.waiting is None else self.waiting


@dataclasses.dataclass(frozen=True)
class Lease:
    """Consecutive batches of one rank in one epoch."""

    indices: np.ndarray  # (sum(sizes),) the batches laid end to end
    sizes: list[int]  # the size of each batch
    end_of_epoch: bool
    epoch_samples: int
    n: int


#: Checkpoint records a coordinator keeps per job (the oldest go first).
CHECKPOINT_HISTORY = 64


@dataclasses.dataclass(frozen=True)
class RankCursor:
    """How far one rank's loop got, as it last reported: `batches` of its `batches_in_epoch`
    batches of `epoch` in the current generation's plan."""

    rank: int
    epoch: int
    batches: int
    batches_in_epoch: int
    reported_ms: int  # Unix time, milliseconds, the coordinator's clock


@dataclasses.dataclass(frozen=True)
class CheckpointRecord:
    """A checkpoint state a job took, as the coordinator recorded it.

    ``step`` is the trainer's global step the checkpoint was named after (None when it named
    none); ``cursor`` and ``origin`` are the state's (``croupier.core.checkpoint``);
    ``amendments`` those of a mixture the recording generation dealt with (the state's);
    ``items`` the items of the cursor's epoch the checkpointing rank had taken (None: not named).
    """

    step: int | None
    cursor: Cursor
    origin: str
    generation: int
    rank: int
    recorded_ms: int
    amendments: tuple[Amendment, ...] = ()
    items: int | None = None  # the items of the cursor's epoch the checkpointing rank had taken


@dataclasses.dataclass(frozen=True)
class JobStatus:
    """What the coordinator holds for one job."""

    spec: Spec
    result: JoinResult
    ranks: tuple[RankCursor, ...] = ()
    checkpoints: tuple[CheckpointRecord, ...] = ()
    #: every amendment recorded, in order: those that hold (with their position), then those pending
    amendments: tuple[Amendment, ...] = ()


def validate_join(req: JoinRequest) -> None:
    """Raises InvalidArgument, naming the value, for a malformed join request."""
    check_name("job name", req.job, MAX_NAME, InvalidArgument)
    if not isinstance(req.spec, Spec):
        raise InvalidArgument(f"spec must be a Spec (got {type(req.spec).__name__})")
    check_name("incarnation", req.incarnation, MAX_NAME, InvalidArgument)
    check_int("world", req.world, 1, MAX_WORLD + 1, InvalidArgument)
    check_int("rank", req.rank, 0, req.world, InvalidArgument)
    if req.epoch is not None:
        check_int("epoch", req.epoch, 0, MAX_COUNT, InvalidArgument)
    if req.resume is not None:
        try:
            validate_cursor(req.spec, req.resume)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
    for a in req.amendments:
        if not isinstance(a, Amendment) or a.at is None:
            raise InvalidArgument(f"a checkpoint's amendments hold from a position each (got {a!r})")
    if req.resume_step is not None:
        check_int("resume_step", req.resume_step, 0, MAX_COUNT, InvalidArgument)
    if req.resume_generation is not None:
        check_int("resume_generation", req.resume_generation, 1, MAX_COUNT, InvalidArgument)
    if (req.resume_step is not None or req.resume_generation is not None) and req.resume is None:
        raise InvalidArgument(f"resume_step={req.resume_step} and resume_generation={req.resume_generation} name the "
                              "checkpoint a rank resumes from: they need its resume point")
    if not isinstance(req.schedule, Schedule):
        raise InvalidArgument(f"schedule must be a Schedule (got {type(req.schedule).__name__})")
