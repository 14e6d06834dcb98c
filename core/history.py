"""A job's history, one model for every kind of job: its runs, the one lineage walk, steps numbered one way.

A job's history is a list of *runs*, each one start of the job's ranks: a generation (a world of
ranks that joined, ``croupier.core.segments.Segment``) or, for a job of torchft replica groups, a
step run (a start of the whole job, ``croupier.core.ftsteps.StepRun``). Each run resumed from a
step of a parent run (a checkpoint it took), or started fresh. The questions asked of a history
are the same for every kind (:class:`History`): what step ``T`` trained (a
:class:`~croupier.core.answers.StepRecord`: the kept :class:`~croupier.core.answers.Version` and
the abandoned ones), every step that trained a sample (:class:`~croupier.core.answers.Occurrence`),
the runs as a timeline; ``croupier.core.ledger.history`` makes the one for a job from what its
coordinator holds.

Steps are numbered one way, from 1, as the trainers log them: step ``T`` is the ``T``-th optimizer
step (Lightning's ``global_step`` and the HF Trainer's ``state.global_step`` once it is taken,
torchft's ``manager.current_step()`` once it committed). A run *resumed at* step ``s`` had ``s``
steps behind it (a checkpoint saved after step ``s``; 0 for a fresh start) and trains steps
``s + 1`` on. torchft numbers the step it is running by the steps committed before it (``T - 1``):
that count is what its loader deals by and what its reports, the coordinator's journal and the old
audit logs carry; it becomes a step number at those edges, nowhere else.

The lineage (:func:`lineage`) is the one walk from the newest run back through its parents: the
runs it passes are *kept* (each up to the step its successor resumed at), what every other run
trained, and what a kept run trained past that step (a rollback), is *abandoned*.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from croupier.core.answers import Occurrence, StepRecord
from croupier.core.checks import is_int
from croupier.core.errors import InvalidArgument
from croupier.core.kept import KeptSteps
from croupier.core.spec import Spec

__all__ = ["History", "LineageCycle", "StepRange", "check_step", "lineage"]

R = TypeVar("R")
P = TypeVar("P")


class LineageCycle(ValueError):
    """The runs' parents make a cycle: :func:`lineage` came back to `run` (the caller names it)."""

    def __init__(self, run: object) -> None:
        super().__init__("the lineage comes back to a run it passed: the runs' parents make a cycle")
        self.run = run


def lineage(latest: R | None, parent: Callable[[R], tuple[R, P] | None]) -> list[tuple[R, P | None]]:
    """The runs `latest` descends from, oldest first, each with the point its successor resumed from.

    Args:
        latest: The newest run (None: an empty history).
        parent: A run's parent and the point (a step, or a checkpoint's place) the run resumed from it;
            None for a fresh start, or a parent the history does not hold.

    Returns:
        ``[(run, until), ...]``: the oldest first; `until` is where the next run on the lineage resumed
        from this one (what of it is kept), None for `latest` (kept to its end).

    Raises:
        LineageCycle: the walk comes back to a run it passed (the runs' parents make a cycle).
    """
    out: list[tuple[R, P | None]] = []
    run, until = latest, None
    while run is not None:
        if any(run is r for r, _ in out):
            raise LineageCycle(run)
        out.append((run, until))
        up = parent(run)
        if up is None:
            break
        run, until = up
    out.reverse()
    return out


def check_step(t: Any) -> int:
    """`t` as a step number (an int >= 1). Raises InvalidArgument naming the value otherwise."""
    if not is_int(t) or t < 1:
        raise InvalidArgument(f"step must be an int >= 1 (steps count from 1, as the trainers log them; got {t!r})")
    return t


class StepRange:
    """``steps(a, b)`` for a history, from its own ``step(t)`` and its check of a step number (``_check_step``)."""

    def _check_step(self, t: int) -> None:
        raise NotImplementedError

    def step(self, t: int) -> StepRecord:
        raise NotImplementedError

    def steps(self, a: int, b: int) -> list[StepRecord]:
        """Steps `a` to `b`, both included."""
        self._check_range(a, b)
        return [self.step(t) for t in range(a, b + 1)]

    def _check_range(self, a: int, b: int) -> None:
        """Refuses what :meth:`steps` refuses: an empty range, or an end that is no step of the history."""
        if is_int(a) and is_int(b) and b < a:
            raise InvalidArgument(f"steps {a}:{b}: the range is empty (the first must be <= the last)")
        self._check_step(a)
        self._check_step(b)


class History(Protocol):
    """What every kind of job's history answers (``croupier provenance`` and ``croupier audit --by-step``
    ask nothing else). `job` and `spec` name the job and its spec (without amendments)."""

    job: str
    spec: Spec

    @property
    def last_step(self) -> int:
        """The last step the job's lineage trained (0 before its first)."""
        ...

    def step(self, t: int) -> StepRecord:
        """What step `t` trained: the kept version and every abandoned one."""
        ...

    def steps(self, a: int, b: int) -> list[StepRecord]:
        """Steps `a` to `b`, both included."""
        ...

    def kept_order(self, a: int, b: int) -> Iterator[KeptSteps]:
        """The kept versions' indices of steps `a` to `b` (both included), in pieces of consecutive steps.

        It MUST answer what ``[r.kept.indices for r in self.steps(a, b)]`` answers (a step with no kept
        version has size ``NO_KEPT``) and refuse what :meth:`steps` refuses, with pieces of at most
        ``croupier.core.kept.PIECE`` samples (or one step), so that a walk over a whole run holds a piece
        at a time.
        """
        ...

    def index(self, index: int, source: int | None = None) -> list[Occurrence]:
        """Every step at which dataset index `index` was trained, kept or abandoned."""
        ...

    def timeline(self) -> list[dict[str, Any]]:
        """Each run: its number, incarnation, world, the steps it trained and up to which it is kept."""
        ...

    def constant_batch(self) -> int | None:
        """The samples per step when every kept step has the same number, else None."""
        ...

    def why_batch_varies(self) -> str:
        """Why :meth:`constant_batch` is None, in words."""
        ...

    def ends_epoch(self, t: int) -> bool:
        """Whether kept step `t` is the last step of its epoch."""
        ...

