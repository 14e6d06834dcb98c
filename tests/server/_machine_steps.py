"""The state machine's model of the training steps: what each step trained, kept on the timeline or abandoned by a rollback.

The loop's own record, not the coordinator's: a step is one pass of the loop in which some rank
took a batch (its batches as the ranks got them), numbered from 1 along the timeline; a restart
from a checkpoint of step s moves the steps after s to the abandoned versions. The coordinator's
step ledger (``CoordinatorClient.ledger``) is checked against it.
"""

from __future__ import annotations

import dataclasses

import pytest

from croupier.core.errors import FailedPrecondition
from croupier.core.ledger import Ledger, Version

#: One version of a step: the incarnation that trained it and each rank's indices.
Trained = tuple[str, dict[int, tuple[int, ...]]]


@dataclasses.dataclass
class Steps:
    """The steps the loop trained: the timeline's and the abandoned versions."""

    count: int = 0  # steps along the timeline
    timeline: dict[int, Trained] = dataclasses.field(default_factory=dict)
    abandoned: dict[tuple[int, str], dict[int, tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    last: dict[str, int] = dataclasses.field(default_factory=dict)  # incarnation -> its last step
    known: int = 0  # steps the coordinator must know: up to the latest checkpoint (or resume) of the timeline
    missing_to: int = 0  # the timeline's steps up to this one are in a store that was lost: the ledger cannot place them

    def record(self, incarnation: str, batches: dict[int, tuple[int, ...]]) -> None:
        self.count += 1
        self.timeline[self.count] = (incarnation, batches)
        self.last[incarnation] = self.count

    def saved(self) -> dict[int, Trained]:
        """The timeline as a checkpoint saves it (a rollback to it restores it)."""
        return dict(self.timeline)

    def rollback(self, step: int, timeline: dict[int, Trained], missing_to: int) -> None:
        """The job resumes from a checkpoint of step `step` that saved `timeline` (it may be one that an
        earlier rollback abandoned): every step of the current timeline not on it is abandoned.

        NOTE: `missing_to` is the checkpoint's, saved with it: the steps a store cannot place belong to a
        timeline, not to the job (docs/provenance.md: a store rebuilt from a checkpoint holds the history
        from it). A resume from an older checkpoint of a lost store lowers it; a rollback within the store
        to a checkpoint saved before that resume raises it again, to where the store was rebuilt from."""
        for t, (name, batches) in self.timeline.items():
            if timeline.get(t, (None,))[0] != name:
                self.abandoned[(t, name)] = batches
        self.timeline = dict(timeline)
        for t, (name, _) in timeline.items():
            self.abandoned.pop((t, name), None)
        self.count = self.known = step
        self.missing_to = missing_to

    def resume_unknown(self, step: int, timeline: dict[int, Trained]) -> None:
        """A rollback to a checkpoint recorded in a store that is gone: the coordinator's history starts
        at it (the versions its own store recorded, abandoned ones included, it still knows)."""
        self.rollback(step, timeline, step)


def _per_rank(v: Version) -> dict[int, tuple[int, ...]]:
    out: dict[int, list[int]] = {}
    for b in sorted(v.batches, key=lambda b: (b.rank, b.micro)):
        out.setdefault(b.rank, []).extend(b.indices.tolist())
    return {r: tuple(i) for r, i in out.items()}


def check_step(ledger: Ledger, steps: Steps, t: int) -> str:
    """Checks the ledger's step `t` against the model; returns what was checked (for the statistics)."""
    if t <= steps.missing_to:
        # NOTE: a checkpoint of a lost store names its generation by the lost store's number; the new store
        # numbers its generations apart from every earlier store's (croupier.server._decide.next_number), so
        # no generation it holds is taken as that checkpoint's parent: these steps are answered "missing".
        with pytest.raises(FailedPrecondition, match="missing|named no step"):
            ledger.step(t)
        return "provenance_missing"
    rec = ledger.step(t)
    name, batches = steps.timeline[t]
    assert rec.kept is not None, f"step {t}: the ledger keeps no version; the loop trained {name}'s"
    assert rec.kept.incarnation == name, f"step {t}: the ledger keeps {rec.kept.incarnation}'s, the loop {name}'s"
    assert _per_rank(rec.kept) == batches, f"step {t}: the ledger says {_per_rank(rec.kept)}, the loop got {batches}"
    for v in rec.abandoned:
        want = steps.abandoned.get((t, v.incarnation))
        if want is None:
            # NOTE: a world killed mid-step may have handed some ranks the next step's batch (and
            # reported it): the ledger may list that one step more of it than the loop trained.
            assert t == steps.last.get(v.incarnation, -1) + 1, (
                f"step {t}: the ledger lists an abandoned version of {v.incarnation} the loop never trained")
        else:
            assert _per_rank(v) == want, f"step {t}: abandoned version of {v.incarnation} differs"
    return "provenance_steps"


def check_index(ledger: Ledger, steps: Steps, t: int, rank: int, index: int) -> None:
    """Sample `index`, trained by `rank` at kept step `t`, is found there by the ledger."""
    gens = {s.incarnation: s.generation for s in ledger.segments}
    name, _ = steps.timeline[t]
    hits = {(o.step, o.rank, o.generation) for o in ledger.index(index) if o.kept}
    assert (t, rank, gens[name]) in hits, f"index {index} (step {t}, rank {rank}): the ledger finds it at {sorted(hits)}"
