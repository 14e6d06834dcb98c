"""croupier's Grain sampler in process: its order, its state on another process count, and what it refuses.

Each "process" here is a Grain ``DataLoader`` with explicit ``ShardOptions`` and no worker
processes, read one after the other in this process (tests/integrations/test_integration_grain.py runs real JAX
processes with Grain workers).
"""

from __future__ import annotations

import collections
import json
import pathlib

import numpy as np
import pytest

grain = pytest.importorskip("grain")

from croupier.integrations import grain as cg  # noqa: E402

N, SEED, EPOCHS = 60, 5, 2


class _Draw(grain.transforms.RandomMap):  # type: ignore[misc]
    """(index, a number drawn from the record's rng): the draw names the record's epoch."""

    def random_map(self, element: int, rng: np.random.Generator) -> np.ndarray:
        return np.array([int(element), int(rng.integers(2**62))], dtype=np.int64)


def _which() -> dict[int, tuple[int, int]]:
    """The (epoch, index) of every draw."""
    from croupier.core.mixture import sample_seed

    return {int(np.random.Generator(np.random.Philox(key=sample_seed(SEED, 0, e, i))).integers(2**62)): (e, i)
            for e in range(EPOCHS) for i in range(N)}


def _loaders(processes: int, batch: int, state: bytes | None = None) -> list[cg.Iterator]:
    its = []
    for k in range(processes):
        sampler = cg.CroupierSampler(N, shard_options=grain.sharding.ShardOptions(k, processes), seed=SEED,
                                     num_epochs=EPOCHS)
        it = iter(cg.DataLoader(data_source=np.arange(N), sampler=sampler,
                                operations=[_Draw(), grain.transforms.Batch(batch, drop_remainder=False)]))
        if state is not None:
            it.set_state(state)
        its.append(it)
    return its


def _epochs_of(processes: int) -> dict[int, collections.Counter[int]]:
    """Per epoch, the indices a full run on `processes` deals (from the sampler's own records)."""
    seen: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for k in range(processes):
        s = cg.CroupierSampler(N, shard_options=grain.sharding.ShardOptions(k, processes), seed=SEED, num_epochs=EPOCHS)
        for j in range(len(s) // processes):
            e, key, _ = s.record(j * processes + k)
            seen[e][key] += 1
    return seen


def test_every_process_count_deals_each_epoch_once() -> None:
    for processes in (1, 2, 3, 4):
        seen = _epochs_of(processes)
        assert sorted(seen) == [0, 1] and all(sorted(c) == list(range(N)) and set(c.values()) == {1}
                                              for c in seen.values()), processes


@pytest.mark.parametrize(("before", "after", "steps"), [(2, 3, 3), (3, 2, 7), (4, 1, 6), (2, 5, 5), (3, 4, 0), (1, 2, 8)])
def test_a_state_saved_on_some_processes_resumes_on_others_exactly_once(before: int, after: int, steps: int) -> None:
    """Each process reads `steps` batches of 4 and saves; the state resumes on `after` processes: every epoch
    holds each index once (the epoch read from the record's draw), and the counts divide (no tail repeats)."""
    which = _which()
    seen: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)

    def count(batch: np.ndarray) -> None:
        for i, d in batch.tolist():
            e, j = which[d]
            assert j == i  # the record's rng is its (epoch, index)'s, whoever deals it
            seen[e][i] += 1

    first = _loaders(before, 4)
    for it in first:
        for _ in range(steps):
            count(next(it))
    states = {it.get_state() for it in first}
    ours = {json.dumps(json.loads(s)["croupier"]) for s in states}
    assert len(ours) == 1  # every process computes the same croupier state
    for it in _loaders(after, 4, states.pop()):
        for b in it:
            count(b)
    assert sorted(seen) == [0, 1]
    for e, c in seen.items():
        assert sorted(c) == list(range(N)) and set(c.values()) == {1}, (e, c)


def test_seeds_do_not_depend_on_who_deals() -> None:
    by_two = {(e, k): s for p in range(2) for e, k, s in map(
        cg.CroupierSampler(N, shard_options=grain.sharding.ShardOptions(p, 2), seed=SEED, num_epochs=EPOCHS).record,
        [j * 2 + p for j in range(N)])}
    alone = cg.CroupierSampler(N, shard_options=grain.sharding.ShardOptions(0, 1), seed=SEED, num_epochs=EPOCHS)
    assert {(e, k): s for e, k, s in map(alone.record, range(2 * N))} == by_two


def test_save_and_restore_across_process_counts(tmp_path: pathlib.Path) -> None:
    first = _loaders(2, 3)
    for it in first:
        next(it)
        cg.save(it, tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["process_0-of-2.json", "process_1-of-2.json"]
    (resumed,) = _loaders(1, 3)
    assert cg.restore(resumed, tmp_path / "ckpt")
    assert sum(len(b) for b in resumed) == EPOCHS * N - 6  # 3 records a process taken before
    assert not cg.restore(_loaders(1, 3)[0], tmp_path / "nothing")


def test_the_state_names_the_step_and_a_restore_counts_on(tmp_path: pathlib.Path) -> None:
    """A process takes a batch a step: the iterator counts them from the job's start, its state names the count."""
    for it in _loaders(2, 3):
        for _ in range(4):
            next(it)
        assert it.step == 4
        cg.save(it, tmp_path / "ckpt")
    (resumed,) = _loaders(1, 3)
    assert cg.restore(resumed, tmp_path / "ckpt") and resumed.step == 4
    next(resumed)
    cursors = json.loads(resumed.get_state())["croupier"]["cursors"]
    assert [c["step"] for c in cursors] == [5] * len(cursors) and "generation" not in cursors[0]
    cg.save(resumed, tmp_path / "named", step=40)  # a step given: named, and counted on from
    assert json.loads((tmp_path / "named" / "process_0-of-1.json").read_text())["croupier"]["cursors"][0]["step"] == 40
    next(resumed)
    assert resumed.step == 41
    old = json.loads((tmp_path / "ckpt" / "process_0-of-2.json").read_text())
    old["croupier"]["cursors"] = [{k: v for k, v in c.items() if k != "step"} | {"version": 3}
                                  for c in old["croupier"]["cursors"]]
    (again,) = _loaders(1, 3, json.dumps(old).encode())  # a state saved before the step was named: none counted
    next(again)
    assert again.step is None and "step" not in json.loads(again.get_state())["croupier"]["cursors"][0]


def test_processes_saved_at_different_steps_are_refused(tmp_path: pathlib.Path) -> None:
    a, b = _loaders(2, 3)
    next(a)
    cg.save(a, tmp_path)
    cg.save(b, tmp_path)
    with pytest.raises(ValueError, match="different positions: every process must be checkpointed at the same step"):
        cg.restore(_loaders(1, 3)[0], tmp_path)


def test_refusals() -> None:
    shard = grain.sharding.ShardOptions(0, 1)
    with pytest.raises(ValueError, match=r"num_records must be >= 1 \(got num_records=0\)"):
        cg.CroupierSampler(0, shard_options=shard)
    with pytest.raises(ValueError, match=r"tail must be one of \['pad', 'drop', 'pad_last'\] \(got tail='uneven'\): every process takes"):
        cg.CroupierSampler(10, shard_options=shard, tail="uneven")
    with pytest.raises(TypeError, match="shard_options must be a grain.sharding.ShardOptions"):
        cg.CroupierSampler(10, shard_options=(0, 1))  # type: ignore[arg-type]
    sampler = cg.CroupierSampler(10, shard_options=shard)
    with pytest.raises(ValueError, match="the data source has 9 records but the sampler was made for 10"):
        cg.DataLoader(data_source=np.arange(9), sampler=sampler)

    class Split(grain.experimental.FlatMapTransform):  # type: ignore[misc]
        max_fan_out = 2

        def flat_map(self, element):  # type: ignore[no-untyped-def]
            return [element, element]

    with pytest.raises(ValueError, match="is a FlatMap"):
        cg.DataLoader(data_source=np.arange(10), sampler=sampler, operations=[Split()])
    it = iter(cg.DataLoader(data_source=np.arange(10), sampler=sampler))
    with pytest.raises(ValueError, match="not a croupier Grain iterator state"):
        it.set_state(b'{"last_seen_indices": {"0": 3}}')
    next(it)
    state = it.get_state()
    with pytest.raises(RuntimeError, match="set_state\\(\\) after the first next\\(\\)"):
        it.set_state(state)
    other = cg.CroupierSampler(10, shard_options=shard, seed=1)
    with pytest.raises(ValueError, match="fingerprint"):
        iter(cg.DataLoader(data_source=np.arange(10), sampler=other)).set_state(state)
