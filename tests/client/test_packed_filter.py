"""Filtered samples in `PackedLoader`: rejected by the dataset or a predicate, counted apart, exact across a resume."""

from __future__ import annotations

import pickle
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _filter_data import FilteringDocs, kept_lengths
from _packing_data import Docs, run_world, token_audit
from torch.utils.data import DataLoader

from croupier.client import FILTERED, DistributedSampler, Indexed, PackedLoader
from croupier.server._service import Server
from croupier.tools.audit import audit, by_source, load, render, render_sources, verdict

SEQ_LEN = 16
LENGTHS = [(i * 29) % 40 + 1 for i in range(60)]
REJECTED = [i for i in range(60) if i % 7 == 3]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with tempfile.TemporaryDirectory() as d:
        s = Server(f"sqlite:///{Path(d) / 'coordinator.db'}").start()
        try:
            yield s
        finally:
            s.stop(grace=0.5)


@pytest.fixture(scope="module")
def address(server: Server) -> str:
    return server.address


def test_the_rejection_value_survives_the_workers_pickling() -> None:
    assert pickle.loads(pickle.dumps(FILTERED)) is FILTERED and not FILTERED
    assert Indexed(FilteringDocs([3, 4], [1]))[1] == (1, FILTERED)


@pytest.mark.parametrize("how", ["dataset", "keep"])
def test_filtered_samples_are_counted_apart_and_exact_across_a_resume_on_another_world(
        address: str, tmp_path: Path, how: str) -> None:
    """2 ranks x 2 workers cut after 3 rows, resumed by 3 ranks x 1 worker: every kept token once, no
    rejected token, and the audit counts each rejected document as filtered (not trained, not missing)."""
    job = uuid.uuid4().hex
    if how == "dataset":
        docs, extra = FilteringDocs(LENGTHS, REJECTED), {}
    else:
        rejected = frozenset(REJECTED)
        docs, extra = Docs(LENGTHS), {"keep": lambda i, tokens: i not in rejected}
    args = {"audit_dir": str(tmp_path)}
    first, states = run_world(address, job, docs, 2, 2, SEQ_LEN, 3, None, sampler_args=args, pack="best_fit",
                              buffer=3, **extra)
    rest, _ = run_world(address, job, docs, 3, 1, SEQ_LEN, None, states[0], sampler_args=args, pack="best_fit",
                        buffer=3, **extra)
    trained = [p for t in first + rest for p in t]
    assert not token_audit(kept_lengths(LENGTHS, REJECTED), trained, None)
    assert not {i for i, _, _ in trained} & set(REJECTED)
    reports = audit(tmp_path)
    assert verdict(reports)[0], render(reports)
    assert [(r.epoch, r.trained, r.filtered, r.duplicates, r.missing) for r in reports] == [
        (0, len(LENGTHS) - len(REJECTED), len(REJECTED), 0, 0)], render(reports)
    assert "filtered" in render(reports).splitlines()[0]


def test_a_filtered_mixture_sample_is_skipped_from_the_next_generation(server: Server, tmp_path: Path) -> None:
    """on_filtered='skip': the checkpoint records the samples filtered so far as skipped; the resumed
    generation never deals them again (the next epoch included), and the audit counts them per source."""
    job, address = uuid.uuid4().hex, server.address
    args = {"audit_dir": str(tmp_path), "weights": [0.5, 0.5], "sources": [30, 30]}
    docs = FilteringDocs(LENGTHS, REJECTED)
    first, states = run_world(address, job, docs, 2, 0, SEQ_LEN, 10, None, sampler_args=args, pack="greedy",
                              on_filtered="skip")
    pending = server.core.job(job).amendments
    assert [(a.kind, a.at) for a in pending] == [("skip", None)]  # the checkpoint recorded what was filtered
    rest, ends = run_world(address, job, docs, 3, 0, SEQ_LEN, None, states[0], sampler_args=args, pack="greedy",
                           on_filtered="skip")
    assert not {i for t in first + rest for i, _, _ in t} & set(REJECTED)
    held = server.core.job(job).amendments
    assert held[0].at is not None and [a.kind for a in held] == ["skip", "skip"]  # the resumed generation held it
    reports = audit(tmp_path)
    assert verdict(reports)[0], render(reports)
    rows = by_source(reports)
    assert sum(r.filtered for r in rows) == reports[0].filtered > 0, render_sources(rows)
    assert "filtered" in render_sources(rows).splitlines()[0]
    # a later generation: no rejected document that was filtered (and so recorded) is dealt again
    seen = {i for incs in load(tmp_path).values() for inc in incs for _, _, i, _ in inc.filtered}
    assert seen and seen <= set(REJECTED)
    s = DistributedSampler(len(docs), num_replicas=1, rank=0, address=address, job=job, seed=3, tail="uneven",
                           incarnation=uuid.uuid4().hex, weights=[0.5, 0.5], sources=[30, 30])
    try:
        s.load_state_dict(ends[0]["sampler"])
        s.set_epoch(1)
        dealt = [int(i) for i in s]
    finally:
        s.close()
    assert dealt and not set(dealt) & seen, sorted(set(dealt) & seen)


def test_what_filtering_refuses(address: str) -> None:
    s = DistributedSampler(6, num_replicas=1, rank=0, address=address, job=uuid.uuid4().hex, tail="uneven")
    dl = DataLoader(Indexed(Docs([3] * 6)), batch_size=None, sampler=s)
    with pytest.raises(ValueError, match=r"on_filtered must be one of \['record', 'skip'\] \(got on_filtered='drop'\)"):
        PackedLoader(dl, s, SEQ_LEN, on_filtered="drop")
    with pytest.raises(ValueError, match=r"on_filtered='skip' records filtered samples as skipped, a change of a "
                                         r"mixture: the sampler deals one dataset"):
        PackedLoader(dl, s, SEQ_LEN, on_filtered="skip")
    with pytest.raises(TypeError, match=r"keep must be a callable keep\(index, tokens\) -> bool \(got 3\)"):
        PackedLoader(dl, s, SEQ_LEN, keep=3)  # type: ignore[arg-type]
    pl = PackedLoader(dl, s, SEQ_LEN, keep=lambda i, t: bool(torch.all(t >= 0)) and i != 2)
    got = [p for b in pl for row in b.pieces for p in row]
    s.close()
    assert sorted(got) == [(i, 0, 3) for i in range(6) if i != 2]
