"""A mixture job's run through a real coordinator, as its ranks report it: a resize with a rollback, new weights, a restart."""

from __future__ import annotations

from croupier.core.amend import Amendment
from croupier.core.api import JoinRequest
from croupier.core.cursor import Cursor
from croupier.core.mixture import parts_of
from croupier.core.registry import plan_epoch
from croupier.core.spec import Spec
from croupier.server._coordinator import Coordinator

JOB = "mix"
#: 120 samples of source 0 and 240 of source 1, weighted 1:3 until the run's amendment makes it 3:1.
SPEC = Spec(n=360, seed=5, batch_size=2, sources=(120, 240), weights=((0, parts_of([1, 3])),))
#: A checkpoint: its cursor, its step, the generation that took it and the amendments it carries.
Checkpoint = tuple[Cursor, int, int, tuple[Amendment, ...]]
#: Checkpoints by step.
Saved = dict[int, Checkpoint]


def generation(core: Coordinator, incarnation: str, world: int, steps: int, resume: Checkpoint | None = None,
               checkpoints: tuple[int, ...] = (), job: str = JOB, spec: Spec = SPEC) -> Saved:
    """A generation of `world` ranks, resuming from `resume` (or fresh), that takes `steps` steps of one batch
    a rank (every rank reporting each) and records a checkpoint after each step in `checkpoints`."""
    cursor, step, parent, amendments = resume if resume is not None else (None, None, None, ())
    for rank in range(world):
        joined = core.join(JoinRequest(job, spec, incarnation, world, rank, cursor, None, amendments, step, parent))
    assert joined.start is not None, "every rank joined: the generation started"
    plan = plan_epoch(spec, joined.start, world, joined.start.epoch)
    assert plan is not None
    saved: Saved = {}
    for k in range(1, steps + 1):
        t = (step or 0) + k
        for rank in range(world):
            if t in checkpoints:
                core.report(job, joined.generation, rank, joined.start.epoch, k, (t, plan.advance(k), f"{incarnation}/{t}"))
            else:
                core.report(job, joined.generation, rank, joined.start.epoch, k)
        if t in checkpoints:
            saved[t] = (plan.advance(k), t, joined.generation, joined.amendments)
    return saved


def run(core: Coordinator) -> None:
    """Generation 1 (2 ranks) trains steps 1-20; generation 2 (3 ranks: a resize) resumes from step 10 (a
    rollback: steps 11-20 of generation 1 are abandoned) and trains 11-25; new weights; generation 3 resumes
    at 25 (the weights change there) and trains 26-33; generation 4 (a restart: no mark) trains 34-40."""
    first = generation(core, "a", 2, 20, checkpoints=(10, 20))
    second = generation(core, "b", 3, 15, first[10], checkpoints=(25,))
    core.amend(JOB, "weights", parts_of([3, 1]))
    third = generation(core, "c", 3, 8, second[25], checkpoints=(33,))
    generation(core, "d", 3, 7, third[33])
