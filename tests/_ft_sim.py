"""A stand-in of torchft's Manager for in-process tests: the quorum, healing and commit calls the loader uses.

It keeps torchft's rules (``torchft/manager.py``): a step number is the count of steps committed;
a quorum's participants are its groups at the quorum's highest step (a group behind heals: it takes
that step, ``batches_committed`` and the user state of a group at it); ``should_commit`` is decided
per group; ``batches_committed`` grows by the participants on a commit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


class FakeManager:
    """One rank's manager. The simulation (:class:`FtSim`) opens each quorum and decides each commit."""

    def __init__(self, sim: FtSim, group: int) -> None:
        self.sim, self.group = sim, group
        self._step = 0
        self._batches_committed = 0
        self._quorum_id = -1
        self._participant: int | None = None
        self._participants = 0
        self.fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        self.quorums_started = 0

    def register_state_dict_fn(self, key: str, load: Callable[[Any], None], save: Callable[[], Any]) -> None:
        self.fns[key] = (load, save)

    def start_quorum(self) -> None:
        self.quorums_started += 1
        self.sim.quorum_for(self)

    def participating_rank(self) -> int | None:
        return self._participant

    def num_participants(self) -> int:
        return self._participants

    def current_step(self) -> int:
        return self._step

    def batches_committed(self) -> int:
        return self._batches_committed

    def should_commit(self) -> bool:
        ok = self.sim.outcome(self.group)
        if ok:
            self._step += 1
            self._batches_committed += self._participants
        return ok

    def state_dict(self) -> dict[str, int]:
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self._step, self._batches_committed = sd["step"], sd["batches_committed"]


@dataclasses.dataclass
class Attempt:
    """One attempt of a step: its quorum and which groups committed it."""

    step: int
    quorum: int
    members: tuple[int, ...]
    commits: dict[int, bool]


class FtSim:
    """The Lighthouse's side: which groups are in the next quorum, and each group's commit decision."""

    def __init__(self) -> None:
        self.managers: dict[int, list[FakeManager]] = {}
        self.members: tuple[int, ...] = ()
        self.quorum = 0
        self.commits: dict[int, bool] = {}
        self.attempts: list[Attempt] = []

    def add_group(self, group: int, ranks: int) -> list[FakeManager]:
        self.managers[group] = [FakeManager(self, group) for _ in range(ranks)]
        return self.managers[group]

    def remove_group(self, group: int) -> None:
        del self.managers[group]

    def open(self, members: tuple[int, ...], commits: dict[int, bool]) -> None:
        """The next attempt's quorum (groups in this order are its participants 0, 1, ...) and outcomes."""
        self.quorum += 1
        self.members = members
        self.commits = commits
        top = max(self.managers[g][0]._step for g in members)
        source = next(g for g in members if self.managers[g][0]._step == top)
        for g in members:
            for r, m in enumerate(self.managers[g]):
                if m._step < top:  # heal from the same rank of a group at the top step
                    peer = self.managers[source][r]
                    m.load_state_dict(peer.state_dict())
                    for key, (load, _) in m.fns.items():
                        load(peer.fns[key][1]())
        self.attempts.append(Attempt(top, self.quorum, members, dict(commits)))

    def quorum_for(self, m: FakeManager) -> None:
        m._quorum_id = self.quorum
        m._participants = len(self.members)
        m._participant = self.members.index(m.group) if m.group in self.members else None

    def outcome(self, group: int) -> bool:
        return self.commits.get(group, False)
