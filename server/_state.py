"""The coordinator's state machine: jobs, generations and resume points, changed only through apply(event).

Deciding and applying are separate. ``decide_join`` checks a request against the state and
returns the events it implies, with every value already decided (the generation number, the
resume point); it changes nothing and raises a domain error for a bad request. ``apply`` makes
one event part of the state and never fails on an event ``decide_join`` produced. Replaying the
journal of events over the last snapshot therefore rebuilds the exact state.

Serving is not an event: batch j of rank r in epoch e of generation g is a pure function of the
generation's resume point and world size (see ``croupier.core.order``), so a repeated
request returns the same batch and a coordinator restart changes nothing a client sees.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Union

from croupier.core.api import MAX_COUNT, MAX_NAME, JoinRequest, JoinResult, validate_join
from croupier.core.checks import check_int, check_name
from croupier.core.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound
from croupier.core.order import Cursor, bind, epoch_agrees, fresh, show
from croupier.core.spec import Spec



# --------------------------------------------------------------------------- requests and events


@dataclasses.dataclass(frozen=True)
class JobRegistered:
    job: str
    spec: Spec


@dataclasses.dataclass(frozen=True)
class GenerationOpened:
    job: str
    generation: int
    world: int
    token: str


@dataclasses.dataclass(frozen=True)
class RankJoined:
    job: str
    generation: int
    rank: int
    resume: Cursor | None
    epoch: int | None


@dataclasses.dataclass(frozen=True)
class GenerationStarted:
    job: str
    generation: int
    start: Cursor


Event = Union[JobRegistered, GenerationOpened, RankJoined, GenerationStarted]
_EVENT_TYPES: dict[str, type] = {t.__name__: t for t in (JobRegistered, GenerationOpened, RankJoined, GenerationStarted)}


def _cursor_to(c: Cursor | None) -> Any:
    return None if c is None else [c.epoch, [[a, b] for a, b in c.remaining], c.base_world]


def _cursor_from(v: Any) -> Cursor | None:
    return None if v is None else Cursor(int(v[0]), tuple((int(a), int(b)) for a, b in v[1]), int(v[2]))


def encode_event(ev: Event) -> dict[str, Any]:
    """A plain (msgpack-able) dict of an event."""
    d: dict[str, Any] = {"type": type(ev).__name__}
    for f in dataclasses.fields(ev):
        v = getattr(ev, f.name)
        if isinstance(v, Spec):
            v = v.to_dict()
        elif isinstance(v, Cursor):
            v = _cursor_to(v)
        d[f.name] = v
    return d


def decode_event(d: Mapping[str, Any]) -> Event:
    """Inverse of :func:`encode_event`."""
    kind = _EVENT_TYPES[d["type"]]
    kw = {k: v for k, v in d.items() if k != "type"}
    if "spec" in kw:
        kw["spec"] = Spec.from_dict(kw["spec"])
    for k in ("resume", "start"):
        if k in kw:
            kw[k] = _cursor_from(kw[k])
    return kind(**kw)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- state


@dataclasses.dataclass
class Generation:
    """One incarnation of a job's world."""

    number: int
    world: int
    token: str
    joined: dict[int, tuple[Cursor | None, int | None]] = dataclasses.field(default_factory=dict)
    start: Cursor | None = None

    def waiting_for(self) -> tuple[int, ...]:
        return tuple(r for r in range(self.world) if r not in self.joined) if self.start is None else ()


@dataclasses.dataclass
class Job:
    """A job: its spec, its current generation, and every token that ever opened one."""

    name: str
    spec: Spec
    generation: Generation | None = None
    tokens: list[str] = dataclasses.field(default_factory=list)


class State:
    """Every job the coordinator holds. Change it only through :meth:`apply`."""

    def __init__(self) -> None:
        self.jobs: dict[str, Job] = {}

    # ---------------------------------------------------------------- decisions

    def decide_join(self, req: JoinRequest) -> list[Event]:
        """The events a join implies; [] when it repeats one already applied (idempotent).

        Raises:
            InvalidArgument: a malformed request.
            FailedPrecondition: another spec than the job's, another world size than the
                generation's, or a resume point / epoch that disagrees with another rank's.
            Aborted: the token belongs to a generation that a newer one replaced.
        """
        validate_join(req)
        events: list[Event] = []
        job = self.jobs.get(req.job)
        if job is None:
            events.append(JobRegistered(req.job, req.spec))
        elif job.spec != req.spec:
            raise FailedPrecondition(
                f"job {req.job!r} was registered with spec ({job.spec.describe()}); this rank sent a "
                f"different spec ({req.spec.describe()})"
            )
        gen = job.generation if job else None
        if gen is not None and req.token == gen.token:
            if req.world != gen.world:
                raise FailedPrecondition(
                    f"generation {gen.number} of job {req.job!r} has world size {gen.world}; "
                    f"rank {req.rank} says world size {req.world}"
                )
            number, world, joined = gen.number, gen.world, dict(gen.joined)
        elif job is not None and req.token in job.tokens:
            current = gen.number if gen else 0
            raise Aborted(
                f"token {req.token!r} belongs to an older generation of job {req.job!r}; "
                f"generation {current} replaced it (this process is a zombie of a previous incarnation)"
            )
        else:
            number, world, joined = (gen.number if gen else 0) + 1, req.world, {}
            events.append(GenerationOpened(req.job, number, req.world, req.token))

        mine = (req.resume, req.epoch)
        if req.rank in joined:
            if joined[req.rank] != mine:
                raise FailedPrecondition(
                    f"rank {req.rank} already joined generation {number} of job {req.job!r} with "
                    f"resume={show(joined[req.rank][0])}, epoch={joined[req.rank][1]}; now it sends "
                    f"resume={show(req.resume)}, epoch={req.epoch}"
                )
            return events
        _check_agreement(req, number, joined)
        events.append(RankJoined(req.job, number, req.rank, req.resume, req.epoch))
        joined[req.rank] = mine
        if len(joined) == world:
            events.append(GenerationStarted(req.job, number, _decide_start(req.spec, joined, world)))
        return events

    # ---------------------------------------------------------------- application

    def apply(self, ev: Event) -> None:
        """Makes one event part of the state."""
        if isinstance(ev, JobRegistered):
            self.jobs[ev.job] = Job(ev.job, ev.spec)
        elif isinstance(ev, GenerationOpened):
            job = self.jobs[ev.job]
            job.generation = Generation(ev.generation, ev.world, ev.token)
            job.tokens.append(ev.token)
        elif isinstance(ev, RankJoined):
            gen = self._generation(ev.job, ev.generation)
            gen.joined[ev.rank] = (ev.resume, ev.epoch)
        elif isinstance(ev, GenerationStarted):
            self._generation(ev.job, ev.generation).start = ev.start
        else:  # pragma: no cover - the Event union is closed
            raise TypeError(f"not an event: {ev!r}")

    def _generation(self, job: str, number: int) -> Generation:
        gen = self.jobs[job].generation
        if gen is None or gen.number != number:
            raise RuntimeError(f"event for generation {number} of job {job!r} does not follow the journal")
        return gen

    # ---------------------------------------------------------------- queries

    def join_result(self, job: str, rank: int) -> JoinResult:
        """Where `rank` of `job`'s current generation stands (after its join was applied)."""
        gen = self.current(job)
        return JoinResult(gen.number, gen.world, gen.start, gen.waiting_for())

    def current(self, job: str) -> Generation:
        """The job's current generation. Raises NotFound for an unknown job."""
        check_name("job name", job, MAX_NAME, InvalidArgument)
        j = self.jobs.get(job)
        if j is None or j.generation is None:
            raise NotFound(f"job {job!r} is not known to this coordinator (a rank must join it first)")
        return j.generation

    def generation(self, job: str, generation: int) -> Generation:
        """The job's generation `generation`, which MUST be the current one and started.

        Raises:
            NotFound: unknown job, or a generation newer than the current one.
            Aborted: an older generation (fenced).
            FailedPrecondition: the generation is still waiting for ranks to join.
        """
        gen = self.current(job)
        check_int("generation", generation, 1, MAX_COUNT, InvalidArgument)
        if generation < gen.number:
            raise Aborted(
                f"generation {generation} of job {job!r} was replaced by generation {gen.number}; "
                "this rank has been fenced off"
            )
        if generation > gen.number:
            raise NotFound(f"job {job!r} has no generation {generation} (the current one is {gen.number})")
        if gen.start is None:
            raise FailedPrecondition(
                f"generation {generation} of job {job!r} is waiting for ranks {list(gen.waiting_for())} to join"
            )
        return gen

    # ---------------------------------------------------------------- snapshots

    def snapshot(self) -> dict[str, Any]:
        """The whole state as a plain (msgpack-able) dict."""
        jobs = []
        for j in self.jobs.values():
            g = j.generation
            gd = None
            if g is not None:
                gd = {
                    "number": g.number,
                    "world": g.world,
                    "token": g.token,
                    "joined": [[r, _cursor_to(c), e] for r, (c, e) in sorted(g.joined.items())],
                    "start": _cursor_to(g.start),
                }
            jobs.append({"name": j.name, "spec": j.spec.to_dict(), "generation": gd, "tokens": list(j.tokens)})
        return {"version": 1, "jobs": jobs}

    @classmethod
    def restore(cls, snap: Mapping[str, Any] | None, events: Sequence[Event] = ()) -> State:
        """A state from a snapshot (None: empty) and the events journaled after it."""
        s = cls()
        if snap is not None:
            if snap.get("version") != 1:
                raise ValueError(f"snapshot version {snap.get('version')!r} is not supported (expected 1)")
            for jd in snap["jobs"]:
                job = Job(jd["name"], Spec.from_dict(jd["spec"]), None, list(jd["tokens"]))
                g = jd["generation"]
                if g is not None:
                    job.generation = Generation(
                        g["number"], g["world"], g["token"],
                        {int(r): (_cursor_from(c), e) for r, c, e in g["joined"]},
                        _cursor_from(g["start"]),
                    )
                s.jobs[job.name] = job
        for ev in events:
            s.apply(ev)
        return s


# --------------------------------------------------------------------------- helpers


def _check_agreement(req: JoinRequest, number: int, joined: Mapping[int, tuple[Cursor | None, int | None]]) -> None:
    """Refuses a join whose resume point or epoch contradicts a rank already joined."""
    resumes = {r: c for r, (c, _) in joined.items() if c is not None}
    hints = {r: e for r, (_, e) in joined.items() if e is not None}
    where = f"generation {number} of job {req.job!r}"
    if req.resume is not None:
        for r, c in resumes.items():
            if c != req.resume:
                raise FailedPrecondition(
                    f"rank {req.rank} resumes {where} from {show(req.resume)}, but rank {r} resumes "
                    f"from {show(c)}: every rank must load the same checkpoint"
                )
        for r, e in hints.items():
            if not epoch_agrees(req.spec, req.resume, e):
                raise FailedPrecondition(
                    f"rank {req.rank} resumes {where} from {show(req.resume)}, which contradicts "
                    f"set_epoch({e}) on rank {r}"
                )
    if req.epoch is not None:
        for r, c in resumes.items():
            if not epoch_agrees(req.spec, c, req.epoch):
                raise FailedPrecondition(
                    f"set_epoch({req.epoch}) on rank {req.rank} contradicts the checkpoint rank {r} "
                    f"resumes {where} from: {show(c)}"
                )
        if not resumes and req.resume is None:
            for r, e in hints.items():
                if e != req.epoch:
                    raise FailedPrecondition(
                        f"set_epoch({req.epoch}) on rank {req.rank} disagrees with set_epoch({e}) on rank {r} in {where}"
                    )


def _decide_start(spec: Spec, joined: Mapping[int, tuple[Cursor | None, int | None]], world: int) -> Cursor:
    """The resume point of a generation whose ranks have all joined (they agree; checked on join)."""
    for c, _ in joined.values():
        if c is not None:
            return bind(spec, c, world)
    epochs = [e for _, e in joined.values() if e is not None]
    return bind(spec, fresh(spec, epochs[0] if epochs else 0), world)
