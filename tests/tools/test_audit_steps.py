"""`croupier audit --by-step`: a resized, rolled-back run of real samplers passes, and a planted divergence (an
altered log record, a ledger segment with a wrong start) is named at its step."""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import threading
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
from _ledger_run import JOB as LEDGER_JOB
from _ledger_run import run as ledger_run
from _ranks import on_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from croupier.client import CoordinatorClient, DistributedBatchSampler, DistributedSampler
from croupier.core.cursor import Cursor, bind, fresh
from croupier.core.ledger import Ledger, Segment, unpack
from croupier.core.registry import plan_epoch
from croupier.core.schedule import Schedule
from croupier.core.spec import Spec
from croupier.server._coordinator import Coordinator
from croupier.server._memory_store import MemoryStore
from croupier.server._service import Server
from croupier.tools.audit import load
from croupier.tools.audit_steps import audit_steps, render_steps
from croupier.tools.cli import main as cli
from tests._budget import examples

N = 101
B, GB = 4, 24  # the batch sampler's batch, and its trainer's global batch: 3 and 2 batches a step on 2 and 3 ranks


@dataclasses.dataclass
class Run:
    """A finished run: its coordinator, audit directory and job."""

    server: Server
    logdir: pathlib.Path
    job: str

    def ledger(self) -> Ledger:
        with CoordinatorClient(self.server.address) as c:
            return c.ledger(self.job)


def _train(run: Run, world: int, incarnation: str, state: dict | None, step0: int, stop: int | None,
           save: set[int], batches: bool) -> dict[int, dict]:
    """One incarnation, each rank a real sampler, to the end of epoch 1 or step `stop`: a step is a batch of every
    rank (the index sampler's batch is one index), or GB samples over the ranks (the last step of an epoch may be
    short); a checkpoint at each step of `save` and at the end. Returns rank 0's states by step."""
    saved: dict[int, dict] = {}

    def rank(r: int) -> None:
        if batches:
            s: Any = DistributedBatchSampler(N, B, world, r, address=run.server.address, job=run.job,
                                             incarnation=incarnation, tail="pad", audit_dir=str(run.logdir),
                                             lease_ahead=2, global_batch=GB)
        else:
            s = DistributedSampler(N, world, r, address=run.server.address, job=run.job, incarnation=incarnation,
                                   tail="uneven", audit_dir=str(run.logdir), lease_ahead=7)
        a = GB // (B * world) if batches else 1
        if state:
            s.load_state_dict(state)
        t = step0

        def checkpoint() -> None:
            st = s.state_dict(step=t)
            if r == 0:
                saved[t] = st

        for epoch in range(s.epoch, 2):
            s.set_epoch(epoch)
            k = 0
            for _ in s:
                k += 1
                if k % a == 0:
                    t += 1
                    if t in save:
                        checkpoint()
                    if t == stop:
                        s.close()
                        return
            if k % a:  # the epoch's short last step
                t += 1
        checkpoint()
        s.close()

    on_ranks(world, rank)
    return saved


def _run(tmp: pathlib.Path, batches: bool) -> Iterator[Run]:
    """Resized 2 -> 3 ranks at a checkpoint, then rolled back to an older checkpoint on 1 rank (2 for batches: the
    pad tail then pads each epoch), over two epochs."""
    server = Server(f"sqlite:///{tmp}/coordinator.db").start()
    try:
        run = Run(server, tmp / "audit", "stepped")
        g1, g2 = (2, 3) if batches else (8, 10)  # the checkpoints the next generations resume from
        ck = _train(run, 2, "g1", None, 0, g1 + 2, {g1}, batches)  # dies after step g1 + 2
        ck2 = _train(run, 3, "g2", ck[g1], g1, None, {g2}, batches)  # resized, trains both epochs
        _train(run, 2 if batches else 1, "g3", ck2[g2], g2, None, set(), batches)  # rolls back to step g2
        yield run
    finally:
        server.stop(grace=0.5)


@pytest.fixture(scope="module")
def indices(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    yield from _run(tmp_path_factory.mktemp("indices"), batches=False)


@pytest.fixture(scope="module")
def batched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    yield from _run(tmp_path_factory.mktemp("batched"), batches=True)


@pytest.mark.parametrize("which", ["indices", "batched"])
def test_a_resized_rolled_back_run_passes(which: str, request: pytest.FixtureRequest,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    run: Run = request.getfixturevalue(which)
    ledger = run.ledger()
    rolled_back = 11 if which == "indices" else 4  # generation 2 trained it; generation 3 resumed before it
    assert [v.generation for v in ledger.step(rolled_back).abandoned] == [2]
    assert ledger.step(rolled_back).kept is not None and ledger.step(rolled_back).kept.generation == 3  # type: ignore[union-attr]
    for logs in (load(run.logdir)[run.job], None):
        a = audit_steps(ledger, logs)
        assert a.ok and a.error is None and a.divergence is None, a
        assert (a.first, a.last) == (1, ledger.last_step)
        assert [(e.epoch, e.missing, e.finished) for e in a.epochs] == [(0, 0, True), (1, 0, True)], a.epochs
        # the pad tail repeats one sample in each epoch's last step (29 and 101 samples left for 2 ranks)
        assert [e.repeats for e in a.epochs] == ([1, 1] if which == "batched" else [0, 0]), a.epochs
        assert a.epochs[1].last == ledger.last_step
    assert cli(["audit", str(run.logdir), "--by-step", "--address", run.server.address]) == 0
    out = capsys.readouterr().out
    assert "G1 holds" in out and f"steps 1-{ledger.last_step} agree with the order and the ranks' audit logs" in out
    assert cli(["audit", "--by-step", "--address", run.server.address]) == 0  # the ledger alone
    assert "agree with the order (the ledger alone)" in capsys.readouterr().out


def _rewrite(path: pathlib.Path, fn: Any) -> None:
    with open(path, "rb") as f:
        recs = list(msgpack.Unpacker(f, raw=False))
    path.write_bytes(b"".join(msgpack.packb(r) for r in fn(recs)))


@pytest.mark.parametrize("plant", ["altered", "dropped", "cut"])
def test_a_planted_log_record_is_named_at_its_step(indices: Run, tmp_path: pathlib.Path, plant: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """An index of a record changed, a record taken out, or epoch 1 cut by the trainer after 7 items (the rank
    handed out nothing more of it, whatever it had leased): the step the ledger places there is named."""
    logdir = tmp_path / "audit"
    shutil.copytree(indices.logdir, logdir)
    (log,) = (logdir / indices.job).glob("g3-r0.audit")
    planted: dict[str, int] = {}

    def alter(recs: list[dict]) -> list[dict]:
        if plant == "cut":
            return [*recs, {"t": "cut", "epoch": 1, "items": 7}]
        batches = [r for r in recs if r["t"] == "batch" and r["epoch"] == 0]
        rec = batches[2]
        planted["item"] = rec["at"] - batches[0]["at"] + (1 if plant == "altered" else 0)  # of generation 3's share
        if plant == "dropped":
            return [r for r in recs if r is not rec]
        idx = np.frombuffer(rec["idx"], dtype="<i8").copy()
        idx[1] = (idx[1] + 1) % N  # an index the run trained elsewhere
        rec["idx"] = idx.tobytes()
        return recs

    _rewrite(log, alter)
    ledger = indices.ledger()
    epoch, end0 = (1, audit_steps(ledger).epochs[0].last) if plant == "cut" else (0, 10)
    step = end0 + planted.get("item", 7) + 1  # from step 10, or epoch 1's first, on 1 rank: a step is one index
    a = audit_steps(ledger, load(logdir)[indices.job])
    assert a.divergence is not None and (a.divergence.step, a.divergence.kind, a.divergence.generation) == (step, "log", 3)
    assert "rank 0" in a.divergence.why
    assert ("nothing (no record holds it)" in a.divergence.why) == (plant == "dropped"), a.divergence.why
    assert ("the trainer cut the epoch after 7 items" in a.divergence.why) == (plant == "cut"), a.divergence.why
    assert audit_steps(ledger).ok  # the ledger alone knows nothing of the log
    assert cli(["audit", str(logdir), "--by-step", "--address", indices.server.address]) == 1
    assert f"DIVERGED at step {step} (epoch {epoch}, generation 3)" in capsys.readouterr().out


def _moved(ledger: Ledger, generation: int, by: int) -> Ledger:
    """The ledger with `generation`'s resume point moved `by` positions (back: < 0)."""
    segs = []
    for s in ledger.segments:
        if s.generation == generation:
            (a, b), *rest = s.start.remaining
            s = dataclasses.replace(s, start=Cursor(s.start.epoch, ((a + by, b), *rest), s.start.base_world))
        segs.append(s)
    return Ledger(ledger.job, ledger.spec, segs)


def test_a_segment_with_a_wrong_start_is_named(indices: Run) -> None:
    ledger = indices.ledger()
    logs = load(indices.logdir)[indices.job]
    assert audit_steps(_moved(ledger, 3, 0), logs).ok
    # back one position: generation 3's first step (11) trains again what step 10 trained
    for mode in (logs, None):
        d = audit_steps(_moved(ledger, 3, -1), mode).divergence
        assert d is not None and (d.step, d.kind, d.generation) == (11, "repeat", 3), d
    # on one position: against the logs, step 11 is not what rank 0 was handed; the ledger alone sees the sample
    # never trained when epoch 0 ends (a step earlier than it did, one sample fewer on 1 rank)
    end = next(e.last for e in audit_steps(ledger).epochs if e.epoch == 0)
    d = audit_steps(_moved(ledger, 3, 1), logs).divergence
    assert d is not None and (d.step, d.kind) == (11, "log"), d
    d = audit_steps(_moved(ledger, 3, 1)).divergence
    assert d is not None and (d.step, d.kind) == (end - 1, "missing") and "1 of its 101 samples never trained" in d.why, d


def test_a_repeat_that_is_not_the_padding_is_named(batched: Run) -> None:
    """The pad tail's padding may repeat a sample; another repeat is a divergence."""
    ledger = batched.ledger()
    d = audit_steps(_moved(ledger, 3, -1)).divergence
    assert d is not None and (d.step, d.kind) == (4, "repeat") and "not as the tail's padding" in d.why, d


def test_what_cannot_be_audited_says_why(indices: Run, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["audit", "--by-step", "--address", indices.server.address, "--job", "nope"]) == 1
    assert "nope: NOT AUDITED by step" in capsys.readouterr().out
    assert cli(["audit", "--address", indices.server.address]) == 2
    assert "--address and --job go with --by-step" in capsys.readouterr().err
    ledger = indices.ledger()
    nameless = Ledger(ledger.job, ledger.spec, [dataclasses.replace(s, step=None) if s.generation == 3 else s
                                                for s in ledger.segments])
    a = audit_steps(nameless)
    assert not a.ok and a.error is not None and "generation 3 resumed from a checkpoint that named no step" in a.error, a


def _to_the_end(address: str, logdir: pathlib.Path, kind: str, world: int, incarnation: str, state: dict | None,
                stop: int | None) -> dict:
    """One generation of real samplers, a batch of every rank a step: from `state` (or fresh) to the end of epoch 1,
    or to step `stop`; checkpointed there once every rank got there (rank 0's state returned), samplers closed."""
    saved: dict = {}
    there = threading.Barrier(world)

    def rank(r: int) -> None:
        if kind in ("mixture", "dynamic"):  # three sources, none judged by the per-step count of missing samples
            s = DistributedBatchSampler(60, 2, world, r, address=address, job=kind, incarnation=incarnation,
                                        audit_dir=str(logdir), sources=[10, 20, 30], weights=[1, 2, 3],
                                        dealing="dynamic" if kind == "dynamic" else "static")
        else:  # even batches: samples repeated on purpose, so not judged either
            s = DistributedBatchSampler(61, 4, world, r, address=address, job=kind, incarnation=incarnation,
                                        audit_dir=str(logdir), even_batches=True)
        t = 0
        if state:
            s.load_state_dict(state)
            t = state["step"]
        for epoch in range(s.epoch, 2):
            s.set_epoch(epoch)
            for _ in s:
                t += 1
                if t == stop:
                    break
            if t == stop:
                break
        there.wait(timeout=60)  # dealt as the ranks ask, a step's batches are known once every rank took them
        st = s.state_dict(step=t)
        if r == 0:
            saved.update(st)
        s.close()

    on_ranks(world, rank)
    return saved


@pytest.mark.parametrize("kind", ["mixture", "even_batches", "dynamic"])
def test_a_job_run_to_the_end_of_an_epoch_passes(tmp_path: pathlib.Path, kind: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A job resized 2 -> 3 ranks mid-epoch, run to the end of epoch 1, checkpointed there and closed: its last epoch
    is finished (no step of epoch 2 follows it, and none needs to), so the audit by step exits 0, with and without
    the logs, and again from a restarted coordinator; stopped inside an epoch, that epoch is open (exit 1)."""
    store, logdir = f"sqlite:///{tmp_path}/coordinator.db", tmp_path / "audit"
    server = Server(store).start()
    try:
        mid = _to_the_end(server.address, logdir, kind, 2, "g1", None, 5)
        assert cli(["audit", "--by-step", "--address", server.address]) == 1  # stopped inside epoch 0
        assert "open along the timeline: " + kind + " epoch 0" in capsys.readouterr().out
        assert cli(["audit", "--by-step", "--address", server.address, "--allow-unfinished"]) == 0
        _to_the_end(server.address, logdir, kind, 3, "g2", mid, None)
        with CoordinatorClient(server.address) as c:
            ledger = c.ledger(kind)
        a = audit_steps(ledger, load(logdir)[kind])
        assert a.ok and [(e.epoch, e.finished) for e in a.epochs] == [(0, True), (1, True)], render_steps([a])
        assert a.last == ledger.last_step and ledger.ends_epoch(a.last) and not ledger.ends_epoch(a.last - 1)
        capsys.readouterr()
        assert cli(["audit", str(logdir), "--by-step", "--address", server.address]) == 0, capsys.readouterr().out
        assert cli(["audit", "--by-step", "--address", server.address]) == 0, capsys.readouterr().out
    finally:
        server.stop(grace=0.5)
    server = Server(store).start()  # the ledger as a restarted coordinator reads it from its store
    try:
        capsys.readouterr()
        assert cli(["audit", str(logdir), "--by-step", "--address", server.address]) == 0, capsys.readouterr().out
        assert "open along the timeline" not in capsys.readouterr().out
    finally:
        server.stop(grace=0.5)


# --------------------------------------------------------------------------- without a server


def test_a_mixture_counts_each_source_epoch_apart() -> None:
    """A mixture run (a resize with a rollback, new weights, a restart) passes; a generation resumed a position
    back repeats a (source, source epoch, sample) at its first step."""
    core = Coordinator(MemoryStore())
    try:
        ledger_run(core)
        spec, blob, _ = core.ledger(LEDGER_JOB)
    finally:
        core.close()
    ledger = Ledger(LEDGER_JOB, spec, unpack(blob))
    a = audit_steps(ledger)
    assert a.ok and a.last == 40 and [(e.epoch, e.samples, e.missing) for e in a.epochs] == [(0, 220, None)], a
    d = audit_steps(_moved(ledger, 3, -1)).divergence  # generation 3 resumed at step 25
    assert d is not None and (d.step, d.kind) == (26, "repeat") and "of source" in d.why and "its source epoch" in d.why, d


def _simulate(spec: Spec, gens: list[tuple[int, int, int, int]]) -> list[Segment]:
    """A trainer's run as the coordinator records it: each (world, steps, back, accumulation) a generation that
    resumes `back` steps before the latest checkpoint and trains `steps` steps, with a checkpoint after each."""
    segments: list[Segment] = []
    checkpoints: dict[int, tuple[Cursor, int]] = {}
    for g, (world, steps, back, accumulate) in enumerate(gens, 1):
        resume = max(0, max(checkpoints, default=0) - back)
        cursor, parent = checkpoints.get(resume, (fresh(spec, 0), None))
        schedule = Schedule(spec.batch_size * world * accumulate if accumulate > 1 else 0)
        seg = Segment(g, f"inc{g}", world, bind(spec, cursor, world), resume, parent if resume else None, schedule)
        segments.append(seg)
        checkpoints = {t: c for t, c in checkpoints.items() if t <= resume}
        t, epoch = resume, seg.start.epoch
        while steps > 0:
            plan = plan_epoch(spec, seg.start, world, epoch)
            if plan is None:
                epoch += 1
                continue
            taken = 0  # batches every rank has taken of this epoch's plan
            while steps > 0:
                a = schedule.at(spec, world, t + 1)
                if not any(plan.lease(r, taken + m, 1)[1] for m in range(a) for r in range(world)):
                    break
                t, steps, taken = t + 1, steps - 1, taken + a
                seg.report(epoch, min(taken, max(plan.steps(r) for r in range(world))))
                checkpoints[t] = (plan.advance(taken), g)
                seg.checkpoint(t)
            if not taken:  # an epoch with nothing to deal (a drop tail on a bigger world): so are all
                break
            epoch += 1
    return segments


specs = st.builds(
    lambda n, b, partition, tail, perm: Spec(n=n, seed=7, batch_size=b, partition=partition, tail=tail,
                                             permutation=perm, buffer_size=7 if perm == "window" else None),
    st.integers(5, 60), st.integers(1, 4), st.sampled_from(["strided", "chunked", "contiguous"]),
    st.sampled_from(["pad", "drop", "uneven", "pad_last"]), st.sampled_from(["feistel", "none", "torch", "window"]))


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs, gens=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 25), st.integers(0, 3), st.integers(1, 2)),
                                 min_size=2, max_size=5))
def test_every_trained_run_passes_and_a_rewound_resume_is_named(spec: Spec, gens: list[tuple[int, int, int, int]]) -> None:
    """Any run a trainer trains passes, whatever its partition, tail, order, resizes, rollbacks and accumulation;
    the last generation resumed one position before its checkpoint is named at its first step."""
    segments = _simulate(spec, gens)
    ledger = Ledger("job", spec, segments)
    a = audit_steps(ledger)
    if ledger.last_step == 0:  # a drop tail on more ranks than samples trains nothing
        assert a.error is not None and "has trained 0 steps" in a.error
        return
    assert a.ok, render_steps([a])
    kept = {row["generation"]: row for row in ledger.timeline() if row["kept_to"] is not None}
    last = segments[-1]
    (lo, _), *_ = last.start.remaining or ((0, 0),)
    if last.generation not in kept or not lo or last.step is None or kept[last.generation]["kept_to"] <= last.step:
        return  # nothing dealt before the resume point in its epoch, or the generation trained nothing
    d = audit_steps(_moved(ledger, last.generation, -1)).divergence
    assert d is not None and (d.step, d.kind, d.generation) == (last.step + 1, "repeat", last.generation), d
