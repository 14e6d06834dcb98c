"""Mixtures through the samplers: the spec's mixture fields, the schedule and caps of the stream, and a
resume 4 -> 3 across a weight change audited exactly once per source epoch."""

from __future__ import annotations

import collections
import pathlib
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import ConcatDataset, TensorDataset

from croupier.client import DistributedSampler, Sample
from croupier.client._shards import mixture_fields
from croupier.core.mixture import PARTS, parts_of
from croupier.core.order import order
from croupier.core.spec import Spec
from croupier.core.stream import Stream
from croupier.server._service import Server
from croupier.tools.audit import audit, by_source, verdict


def _per_source_epoch(stream: Stream, stop: int) -> dict[tuple[int, int], list[int]]:
    idx, src, sep = stream.indices(np.arange(stop))
    out: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
    for i, s, e in zip(idx.tolist(), src.tolist(), sep.tolist()):
        out[(s, e)].append(i)
    return out


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=2, max_size=5), data=st.data())
def test_every_source_epoch_deals_each_sample_once_across_weight_changes_and_caps(sizes: list[int], data) -> None:
    k = len(sizes)
    weights = st.lists(st.integers(0, 9), min_size=k, max_size=k).filter(any)
    at = sorted(set(data.draw(st.lists(st.integers(1, 400), max_size=3))))
    changes = tuple((p, parts_of(data.draw(weights))) for p in [0, *at])
    caps = tuple(data.draw(st.lists(st.integers(0, 3), min_size=k, max_size=k)))
    last = changes[-1][1]
    if not any(p and not c for p, c in zip(last, caps)):
        caps = tuple(0 if p else c for p, c in zip(last, caps))  # one weighted source without a cap
    try:
        stream = Stream(tuple(sizes), changes, caps)
    except ValueError as e:  # a gap between changes where every weighted source is spent: refused by name
        assert "nothing to deal" in str(e)
        return
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    for (s, e), got in _per_source_epoch(stream, 1200).items():
        assert len(got) == len(set(got)), f"source {s} epoch {e} dealt a sample twice"
        assert all(offsets[s] <= i < offsets[s] + sizes[s] for i in got)
        if caps[s]:
            assert e < caps[s], f"source {s} dealt in its epoch {e}, past max_epochs={caps[s]}"
    # A source's count goes on across every change: whole epochs are whole.
    counts = stream.dealt_before(1200)
    for (s, e), got in _per_source_epoch(stream, 1200).items():
        if e < counts[s] // sizes[s]:
            assert sorted(got) == list(range(offsets[s], offsets[s] + sizes[s]))


def test_a_capped_source_stops_and_its_weight_goes_to_the_others_in_proportion() -> None:
    stream = Stream((10, 100, 100), ((0, parts_of([2, 1, 1])),), (1, 0, 0))
    idx, src, _ = stream.indices(np.arange(400))
    assert (src == 0).sum() == 10  # one epoch of its own, then no more
    after = src[np.flatnonzero(src == 0)[-1] + 1:]
    c = collections.Counter(after.tolist())
    assert set(c) == {1, 2} and abs(c[1] - c[2]) <= 1  # the others, still 1 : 1


def test_the_mixture_spec_travels_through_msgpack_with_its_fingerprint() -> None:
    spec = Spec(n=300, sources=(40, 160, 500), weights=((0, parts_of([5, 3, 2])), (450, parts_of([1, 1, 8]))),
                max_epochs=(2, 0, 0))
    back = Spec.from_dict(msgpack.unpackb(msgpack.packb(spec.to_dict()), raw=False))
    assert back == spec and hash(back) == hash(spec) and back.fingerprint == spec.fingerprint
    assert spec.space == 700
    got = order(spec, 3, np.arange(300))
    assert got.min() >= 0 and got.max() < 700
    assert Spec(n=300).fingerprint == Spec(n=300, sources=None).fingerprint  # older specs keep theirs


@pytest.mark.parametrize("kwargs, words", [
    (dict(weights=[1, 2]), "ConcatDataset"),
    (dict(weights=[1, 2], sources=[5, 5, 5]), "name 2 sources; there are 3"),
    (dict(weights=[1, -2], sources=[5, 5]), "-2"),
    (dict(weights=[0, 0], sources=[5, 5]), "add up to"),
    (dict(sources=[5, 5]), "need weights="),
    (dict(weights=[1, 1], sources=[5, 0]), "sources[1]"),
    (dict(weights=[(0, [1, 1]), (0, [1, 2])], sources=[5, 5]), "must increase"),
    (dict(weights=[(5, [1, 1])], sources=[5, 5]), "start at position 0"),
    (dict(weights=[1, 1], sources=[5, 5], max_epochs=[1, 1]), "nothing to deal"),
    (dict(weights=[1, 1], sources=[5, 5], permutation="window", buffer_size=4), "permutation='window'"),
])
def test_a_bad_mixture_is_refused_by_name(kwargs: dict, words: str) -> None:
    with pytest.raises((ValueError, TypeError)) as e:
        DistributedSampler(10, num_replicas=1, rank=0, **kwargs)
    assert words in str(e.value)


def test_a_concat_dataset_names_its_sources() -> None:
    ds = ConcatDataset([TensorDataset(torch.zeros(7)), TensorDataset(torch.zeros(3))])
    assert mixture_fields(ds, [1, 1], None, None)["sources"] == (7, 3)
    assert mixture_fields(ds, [(0, [1, 1]), (100, [1, 0])], None, [None, 2])["weights"][1] == (100, (PARTS, 0))


# --------------------------------------------------------------------------- resume 4 -> 3, audited

N, SOURCES = 240, [30, 90, 400]
#: the weights change at stream position 400, in epoch 1, after the checkpoint the job resumes from
SCHEDULE = [(0, [5, 3, 2]), (400, [1, 1, 8])]


def _incarnation(server: Server, logdir: pathlib.Path, world: int, incarnation: str, state: dict | None,
                 epochs: int, stop_at: int | None, save_at: int | None) -> dict:
    from _ranks import on_ranks

    saved: dict = {}

    def rank(r: int) -> None:
        s = DistributedSampler(N, world, r, address=server.address, job="mix", incarnation=incarnation, tail="uneven",
                               sources=SOURCES, weights=SCHEDULE, audit_dir=str(logdir), lease_ahead=8)
        if state:
            s.load_state_dict(state)
        for _ in range(epochs):
            for k, _ in enumerate(s, 1):
                if k == save_at and r == 0:
                    saved.update(s.state_dict())
                if k == stop_at:
                    s.close()
                    return
        s.close()

    on_ranks(world, rank)
    return saved


@pytest.mark.e2e
def test_a_mixture_resumed_4_to_3_across_a_weight_change_is_exactly_once_per_source_epoch(
        server: Server, tmp_path: pathlib.Path) -> None:
    ck = _incarnation(server, tmp_path, 4, "g1", None, 1, stop_at=30, save_at=20)  # killed at 30, saved at 20
    assert ck["epoch"] == 0
    _incarnation(server, tmp_path, 3, "g2", ck, 2, stop_at=None, save_at=None)  # epochs 0 (rest) and 1
    reports = audit(tmp_path)
    ok, summary = verdict(reports)
    assert ok, summary
    assert [(r.epoch, r.finished, r.duplicates, r.missing) for r in reports] == [(0, True, 0, 0), (1, True, 0, 0)]
    rows = by_source(reports)
    assert all(r.duplicates == 0 and r.missing == 0 for r in rows)
    # The small source went round many times; its epochs dealt in full each hold every sample once.
    whole = [r for r in rows if r.source == 0 and r.expected == r.size]
    assert len(whole) >= 5 and all(r.trained == 30 for r in whole)
    # The change is in the stream: source 2 deals 8 in 10 after it, 2 in 10 before.
    spec = Spec(n=N, sources=tuple(SOURCES), weights=tuple((a, parts_of(w)) for a, w in SCHEDULE))
    _, src, _ = __import__("croupier.core.permute", fromlist=["x"]).mixture_order(spec, 1, np.arange(N))
    assert (src[:160] == 2).sum() == 32 and (src[160:] == 2).sum() == 64
    out = subprocess.run([sys.executable, "-m", "croupier.tools.cli", "audit", str(tmp_path)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "by source and source epoch" in out.stdout and "every sample exactly once" in out.stdout


# --------------------------------------------------------------------------- per-sample seeds


class Augmented(torch.utils.data.Dataset):
    """Each sample with a random crop drawn from its own seed (what a real dataset's augmentation does)."""

    def __len__(self) -> int:
        return 120

    def __getitem__(self, i: Sample) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i.seed)
        return torch.tensor([int(i), i.source, i.source_epoch]), torch.rand(3, generator=g)


def _augmentations(server: Server, world: int, incarnation: str, job: str, state: dict | None, save_at: int | None,
                   workers: int, saved: dict) -> dict[tuple[int, int, int], tuple[float, ...]]:
    """What every rank of one generation trained, as {(index, source, source epoch): its crop}, to the end of
    epoch 1 (or to `save_at` items of a rank, where rank 0 saves its state into `saved`)."""
    from _ranks import on_ranks

    from croupier.client import worker_options

    got: dict[tuple[int, int, int], tuple[float, ...]] = {}

    def rank(r: int) -> None:
        s = DistributedSampler(Augmented(), world, r, address=server.address, job=job, incarnation=incarnation, tail="uneven",
                               sources=[20, 50, 200], weights=[3, 2, 5], tag=True, lease_ahead=8)
        if state:
            s.load_state_dict(state)
        if save_at is not None:  # the items one at a time, in this process
            for k, i in enumerate(s, 1):
                key, crop = Augmented()[i]
                got[tuple(key.tolist())] = tuple(crop.tolist())
                if k == save_at:
                    if r == 0:
                        saved.update(s.state_dict())
                    break
        else:  # through a DataLoader and its worker processes, to the end of epoch 1
            loader = torch.utils.data.DataLoader(Augmented(), batch_size=4, sampler=s, **worker_options(workers))
            for _ in range(2):  # the rest of epoch 0, then epoch 1 (the sampler moves on by itself)
                for keys, crops in loader:
                    for key, crop in zip(keys.tolist(), crops.tolist()):
                        assert tuple(key) not in got, f"{key} trained twice"
                        got[tuple(key)] = tuple(crop)
        s.close()

    on_ranks(world, rank)
    return got


@pytest.mark.e2e
def test_augmentations_are_the_same_after_a_4_to_3_resume_with_2_workers(server: Server) -> None:
    whole = _augmentations(server, 4, "ref", "reference", None, None, 0, {})
    assert len(whole) == 240  # two epochs, every sample of the stream once
    saved: dict = {}
    before = _augmentations(server, 4, "g1", "resumed", None, 10, 0, saved)
    after = _augmentations(server, 3, "g2", "resumed", saved, None, 2, {})
    assert not set(before) & set(after), "trained before the checkpoint and again after it"
    assert {**before, **after} == whole  # the same samples, each with the same crop


@pytest.mark.parametrize("how", ["fixed", "dynamic", "tokens"])
def test_every_way_of_dealing_tags_each_sample_with_its_source_epoch_and_seed(how: str) -> None:
    from croupier.client import DistributedBatchSampler
    from croupier.core.mixture import sample_seed
    from croupier.core.permute import mixture_order

    kw: dict = dict(sources=[7, 30, 63], weights=[(0, [5, 3, 2]), (60, [1, 1, 1])], tag=True, num_replicas=1, rank=0,
                    seed=3, tail="uneven")
    if how == "tokens":
        kw.update(lengths=np.arange(100) % 9 + 1, max_tokens=20)
    else:
        kw.update(batch_size=4, dealing="dynamic" if how == "dynamic" else "static")
    s = DistributedBatchSampler(100, **kw)
    got = [i for _ in range(2) for batch in s for i in batch]  # epochs 0 and 1
    assert all(isinstance(i, Sample) for i in got)
    spec = s.spec
    want = set()
    for e in (0, 1):
        idx, src, sep = mixture_order(spec, e, np.arange(100))
        want |= set(zip(idx.tolist(), src.tolist(), sep.tolist()))
    assert {(int(i), i.source, i.source_epoch) for i in got} == want
    assert all(i.seed == sample_seed(3, i.source, i.source_epoch, int(i)) for i in got)
    s.close()


@pytest.mark.parametrize("spec", [
    Spec(n=300, sources=(40, 160, 500), weights=((0, parts_of([5, 3, 2])), (450, parts_of([1, 1, 8]))),
         max_epochs=(2, 0, 0), seed=9, permutation="none"),
    Spec(n=30, sources=(10, 20), weights=((0, parts_of([1, 1])),), max_epochs=(0, 0)),
    Spec(n=300),
])
def test_the_mixture_spec_travels_to_the_coordinator_whole(spec: Spec) -> None:
    from croupier.core.wire import spec_from_proto, spec_to_proto
    from croupier.v1 import coordinator_pb2 as pb

    back = spec_from_proto(pb.Spec.FromString(spec_to_proto(spec).SerializeToString()))
    assert back == spec and back.fingerprint == spec.fingerprint
