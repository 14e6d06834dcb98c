"""The inference demo's audit: what the coordinator journaled about the job, read back from its store, and
the workers' output lines checked against it.

An output line is *valid* iff its batch's ``seq`` is below the highest count its (generation, rank)
committed, as the coordinator journaled it (``BatchesCommitted``; incarnations map to generations by
``GenerationOpened``). The valid lines must cover [0, N) exactly once, each with the right output; the
others (work redone after a kill) are counted as discarded.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib

from croupier.demos.infer_worker import infer

#: The demo's job.
JOB = "infer"


class DemoError(RuntimeError):
    """Something the demo did not inject went wrong: a coordinator that would not start, a hang."""



# ------------------------------------------------------------------------------------------- journal


@dataclasses.dataclass
class Journal:
    """What the coordinator journaled about the job, gathered over several reads of its store.

    Attributes:
        generations: incarnation -> generation number (``GenerationOpened``, or a snapshot's current generation).
        worlds: generation -> world size.
        commits: "generation/rank" -> the highest number of batches it committed (``BatchesCommitted``,
            or a snapshot's commits of its current generation).
        logged: The same from journal records alone: a count above it in `commits` was known only
            from a snapshot (its records were pruned).
        dealt: "generation/rank" -> batches dealt to it (``BatchesDealt``, or a snapshot's deals).
        reads: Reads of the store.
        records: Journal records read (over all reads; a record read twice counts twice).
        snapshots: Reads that found a snapshot (which had pruned the records before it).
    """

    generations: dict[str, int] = dataclasses.field(default_factory=dict)
    worlds: dict[int, int] = dataclasses.field(default_factory=dict)
    commits: dict[str, int] = dataclasses.field(default_factory=dict)
    logged: dict[str, int] = dataclasses.field(default_factory=dict)
    dealt: dict[str, int] = dataclasses.field(default_factory=dict)
    reads: int = 0
    records: int = 0
    snapshots: int = 0

    def committed(self, generation: int, rank: int) -> int:
        """Batches of its sequence `rank` committed in `generation` (0 if none)."""
        return self.commits.get(f"{generation}/{rank}", 0)

    def from_snapshots(self) -> int:
        """(generation, rank) pairs whose highest commit only a snapshot showed."""
        return sum(v > self.logged.get(k, 0) for k, v in self.commits.items())

    def redealt(self) -> int:
        """Batches dealt to a rank that never committed them (in flight when it was stopped): dealt again later."""
        return sum(max(0, d - self.commits.get(k, 0)) for k, d in self.dealt.items())

    def _commit(self, generation: int, rank: int, batches: int, logged: bool) -> None:
        key = f"{generation}/{rank}"
        self.commits[key] = max(self.commits.get(key, 0), batches)
        if logged:
            self.logged[key] = max(self.logged.get(key, 0), batches)

    def _open(self, incarnation: str, generation: int, world: int) -> None:
        if self.generations.get(incarnation, generation) != generation:
            raise DemoError(f"the journal maps incarnation {incarnation!r} to generation {generation}, an earlier read to "
                            f"{self.generations[incarnation]}")
        self.generations[incarnation] = generation
        self.worlds[generation] = world

    def read(self, store_url: str, job: str = JOB) -> None:
        """Adds what the store holds now: its snapshot's current generation and every record after it.

        The store MUST NOT be open elsewhere (a SQLite store is locked by its running coordinator).
        """
        from croupier.server import BatchesCommitted, BatchesDealt, GenerationOpened, generation_deals, open_store, read_journal

        store = open_store(store_url)
        try:
            rec = read_journal(store)
        finally:
            store.close()
        self.reads += 1
        dealt: dict[str, int] = {}  # this read's count: a record read again must not count twice
        if rec.snapshot is not None:
            self.snapshots += 1
            g = generation_deals(rec.snapshot, job, 0)
            if g is not None:
                self._open(g.incarnation, g.generation, g.world)
                for rank, batches in g.committed.items():
                    self._commit(g.generation, rank, batches, logged=False)
                for rank, count in g.dealt.items():
                    dealt[f"{g.generation}/{rank}"] = count
        for _, ev in rec.events:
            self.records += 1
            if isinstance(ev, GenerationOpened) and ev.job == job:
                self._open(ev.incarnation, ev.generation, ev.world)
            elif isinstance(ev, BatchesCommitted) and ev.job == job and ev.epoch == 0:
                self._commit(ev.generation, ev.rank, ev.batches, logged=True)
            elif isinstance(ev, BatchesDealt) and ev.job == job and ev.epoch == 0:
                key = f"{ev.generation}/{ev.rank}"
                dealt[key] = dealt.get(key, 0) + ev.count
        for key, count in dealt.items():
            self.dealt[key] = max(self.dealt.get(key, 0), count)

    def save(self, path: pathlib.Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: pathlib.Path) -> Journal:
        d = json.loads(path.read_text())
        return cls(d["generations"], {int(k): v for k, v in d["worlds"].items()}, d["commits"], d["logged"],
                   d["dealt"], d["reads"], d["records"], d["snapshots"])


# --------------------------------------------------------------------------------------------- audit


@dataclasses.dataclass
class Audit:
    """The audit's figures; `violations` names every way it failed (empty: exactly once holds)."""

    n: int
    files: int = 0
    lines: int = 0  # output lines read (torn ones included)
    valid: int = 0  # lines of committed batches
    discarded: int = 0  # lines of batches never committed: work redone after a kill
    torn: int = 0  # a killed worker's last, partly written line (discarded too)
    samples: int = 0  # distinct indices of [0, N) with a valid output
    duplicates: int = 0  # valid lines beyond the first of their index
    missing: int = 0  # indices of [0, N) without a valid output
    wrong: int = 0  # valid lines whose index is outside [0, N) or whose output is not the model's
    violations: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


def _owner(path: pathlib.Path) -> tuple[str, int]:
    """(incarnation, rank) of an output file ``{incarnation}-r{rank}.jsonl``."""
    incarnation, _, rank = path.stem.rpartition("-r")
    if not incarnation or not rank.isdigit():
        raise ValueError(f"{path.name} is not named INCARNATION-rRANK.jsonl")
    return incarnation, int(rank)


def audit(outputs: pathlib.Path, journal: Journal, n: int) -> Audit:
    """Checks that the committed output lines under `outputs` cover [0, `n`) exactly once."""
    a = Audit(n)
    seen: dict[int, list[str]] = collections.defaultdict(list)  # index -> where its valid lines are
    for path in sorted(outputs.glob("*.jsonl")):
        a.files += 1
        try:
            incarnation, rank = _owner(path)
        except ValueError as e:
            a.violations.append(f"unknown output file: {e}")
            continue
        generation = journal.generations.get(incarnation)
        committed = 0 if generation is None else journal.committed(generation, rank)
        data = path.read_text(encoding="utf-8")
        lines = data.split("\n")
        tail = lines.pop()  # "" when the file ends with a newline
        if tail:
            try:
                json.loads(tail)
                lines.append(tail)  # complete, only its newline is missing
            except ValueError:
                a.lines += 1
                a.torn += 1
                a.discarded += 1
        for k, line in enumerate(lines, 1):
            a.lines += 1
            try:
                rec = json.loads(line)
                seq, index, output = int(rec["seq"]), int(rec["index"]), str(rec["output"])
            except (ValueError, KeyError, TypeError):
                a.violations.append(f"corrupt line: {path.name}:{k} is not an output record ({line[:60]!r})")
                continue
            if seq >= committed:
                a.discarded += 1
                continue
            a.valid += 1
            if not 0 <= index < n or output != infer(index):
                a.wrong += 1
                if a.wrong <= 3:
                    a.violations.append(f"wrong output: {path.name}:{k} has index {index} -> {output!r}")
                continue
            seen[index].append(f"{path.name} seq {seq}")
        if generation is None and lines:
            a.violations.append(f"unknown incarnation: {path.name} holds {len(lines)} lines of incarnation {incarnation!r}, "
                                "which the journal never opened")
    a.samples = len(seen)
    dups = {i: w for i, w in seen.items() if len(w) > 1}
    a.duplicates = sum(len(w) - 1 for w in dups.values())
    a.missing = n - a.samples
    if dups:
        i = min(dups)
        a.violations.append(f"duplicates: {len(dups)} indices have more than one committed output ({a.duplicates} "
                            f"extra lines), e.g. index {i} in {', '.join(dups[i])}")
    if a.missing:
        gone = [i for i in range(n) if i not in seen]
        a.violations.append(f"missing: {a.missing} indices have no committed output, e.g. {gone[:5]}")
    return a
