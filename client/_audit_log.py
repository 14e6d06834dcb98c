"""The audit log a sampler writes: what each rank received, and which checkpoints it made.

Each rank of each incarnation appends msgpack records to ``LOGDIR/JOB/INCARNATION-rRANK.audit``:

* ``start``: the generation (number, world, its incarnation under the key ``token``), the spec's n / tail / partition, the wall
  clock, the ``origin`` of the checkpoint state it resumed from (its name; None: a fresh start)
  and ``resumed``, where that state was taken (:func:`resumed_record`; None: a fresh start); for
  a mixture, its ``mixture`` (:func:`mixture_record`);
* ``batch``: epoch, ``at`` (how many items of the epoch this rank had received before this
  chunk, counted from the epoch's start as ``len()`` counts them), and the chunk's indices
  (little-endian int64);
* ``end``: the rank's last item of the epoch was handed out;
* ``cut``: the loop moved on to the next epoch (``set_epoch``) after ``items`` items of this one:
  the rest of the epoch is not trained;
* ``ckpt``: a checkpoint state the sampler made: its ``origin`` (its name), epoch, items and the
  trainer's ``step`` (None: not named).
* ``filtered``: the sample handed out at this rank's item ``at`` of the epoch (``index``) was
  filtered out after loading (written by ``PackedLoader``): trained in no row, not missing.

Logs written before ``resumed`` existed name the checkpoint only by its origin, which
``croupier audit`` reads for them alone.

A rank of a torchft replica group (``croupier.integrations.torchft``) writes the same kind of file,
``LOGDIR/JOB/ft-GROUP-rRANK-PID.audit``: a ``start`` with the job, its ``group``, ``rank`` and group
``world``, the dataset's ``n`` and how steps are sized (``mode``, ``batch``); then a ``step`` per
attempted step: its run (``run``, ``parent``, ``resumed``), ``step`` (numbered from 1), ``quorum``,
``participants``, whether it ``counted`` and ``committed``, the step's stream span (``first``,
``last``), this rank's part of it (``start``, ``stop``) and its indices (``idx``).

``croupier audit`` reads them back, every kind alike (:mod:`croupier.tools.audit_log`).
"""

from __future__ import annotations

import os
import pathlib
import time
from typing import TYPE_CHECKING, Any, BinaryIO

import msgpack
import numpy as np

if TYPE_CHECKING:
    from croupier.core.amend import Amendment
    from croupier.core.checkpoint import Taken
    from croupier.core.spec import Spec


def resumed_record(taken: Taken, resumed: tuple[int, int | None] | None) -> dict[str, Any] | None:
    """The start record's ``resumed``: the checkpoint state a generation resumed from, as fields.

    ``incarnation`` and ``generation`` name who took it (None where the state does not: a state
    of an earlier format, or one a coordinator's record gave back, which names the generation
    alone), ``epoch`` and ``items`` how far the checkpointing rank had got (items None: not named),
    ``step`` the trainer's step. None for a fresh start (no state loaded).
    """
    if resumed is None:
        return None
    epoch, items = resumed
    return {"incarnation": taken.incarnation, "generation": taken.generation, "epoch": epoch, "items": items,
            "step": taken.step}


def mixture_record(spec: Spec, amendments: tuple[Amendment, ...]) -> dict[str, Any]:
    """A mixture's settings and the amendments its generation deals with, for the start record (the
    audit recomputes its stream from them); {} for a spec that is not a mixture."""
    if spec.sources is None:
        return {}
    return {"mixture": {"sources": list(spec.sources), "weights": [[a, list(p)] for a, p in spec.weights or ()],
                        "max_epochs": list(spec.max_epochs or ()), "seed": spec.seed,
                        "shuffle": spec.permutation == "feistel", "amendments": [a.to_list() for a in amendments]}}


class AuditLog:
    """Appends one rank's records; each record is flushed so a kill -9 loses at most the last one."""

    def __init__(self, root: str | os.PathLike[str], job: str, incarnation: str, rank: int) -> None:
        d = pathlib.Path(root) / job
        d.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in incarnation)
        self._f: BinaryIO = open(d / f"{safe}-r{rank}.audit", "ab")

    def write(self, **record: Any) -> None:
        self._f.write(msgpack.packb(record))
        self._f.flush()

    def start(self, **kw: Any) -> None:
        self.write(t="start", ts=time.time(), **kw)

    def batch(self, epoch: int, at: int, indices: np.ndarray) -> None:
        self.write(t="batch", epoch=epoch, at=at, idx=np.ascontiguousarray(indices, dtype="<i8").tobytes())

    def ckpt(self, origin: str, epoch: int, items: int, step: int | None = None) -> None:
        self.write(t="ckpt", origin=origin, epoch=epoch, items=items, step=step)

    def filtered(self, epoch: int, at: int, index: int) -> None:
        self.write(t="filtered", epoch=epoch, at=at, index=index)

    def close(self) -> None:
        self._f.close()
