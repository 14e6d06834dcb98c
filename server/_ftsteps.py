"""A fault-tolerant job's committed steps: the decision a report makes (``croupier.core.ftsteps``)."""

from __future__ import annotations

from croupier.core.checks import check_int
from croupier.core.errors import FailedPrecondition, InvalidArgument
from croupier.core.ftsteps import MODES, CommittedStep, Steps
from croupier.core.spec import Spec
from croupier.server._events import Event, JobRegistered, StepCommitted
from croupier.server._jobs import Job

#: A run's name: at most this many characters (the run is an incarnation: a uuid).
MAX_RUN = 128


def decide_commit(jobs: dict[str, Job], job: str, spec: Spec, run: str, parent: str, resumed: int, mode: str,
                  batch: int, step: CommittedStep) -> tuple[bool, list[Event]]:
    """Whether a committed step is new, and the events that record it ([] when it was recorded already).

    A job's first report registers it with `spec`; every later one must send the same spec.

    Raises:
        InvalidArgument: a malformed report (the message names the field and value).
        FailedPrecondition: another spec than the job's, a job dealt by ranks' generations, or a
            report that contradicts its run's record (another span for a recorded step, another
            resume point or batch for the run).
    """
    if not run or len(run) > MAX_RUN:
        raise InvalidArgument(f"a step report names its run (1 to {MAX_RUN} characters; got {run!r})")
    if len(parent) > MAX_RUN:
        raise InvalidArgument(f"a step report's parent run has at most {MAX_RUN} characters (got {len(parent)})")
    if mode not in MODES:
        raise InvalidArgument(f"a step report's mode must be one of {', '.join(map(repr, MODES))} (got {mode!r})")
    for name, value, low in (("batch", batch, 1), ("resumed", resumed, 0), ("step", step.to_list()[0], 0),
                             ("start", step.start, 0), ("participants", step.participants, 1), ("quorum", step.quorum, 0)):
        check_int(f"a step report's {name}", value, low, None, InvalidArgument)
    j = jobs.get(job)
    if j is not None:
        if j.spec != spec:
            raise FailedPrecondition(f"job {job!r} was registered with spec ({j.spec.describe()}); this step report "
                                     f"sent a different spec ({spec.describe()})")
        if j.generation is not None or j.ledger:
            raise FailedPrecondition(f"job {job!r} is dealt to ranks by generations (its samplers join it); a "
                                     "fault-tolerant job's steps must be reported under a job name of their own")
    record = j.steps if j is not None else Steps()
    why = record.check(run, parent, resumed, mode, batch, step)
    if why is not None:
        raise FailedPrecondition(f"job {job!r}: {why}")
    if not record.is_new(run, step):
        return False, []
    events: list[Event] = [] if j is not None else [JobRegistered(job, spec)]
    events.append(StepCommitted(job, run, parent, resumed, mode, batch, *step.to_list()))  # the journal's form
    return True, events
