"""`PackedLoader` checkpoints exactly: trained to a cut, resumed on another world and worker count, every token once."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from _packing_data import CONTEXT, Docs, run_world, token_audit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from croupier.client import DistributedSampler, Indexed, PackedLoader

SEQ_LEN = 16


@pytest.fixture(scope="module")
def address(module_address: str) -> str:
    """One in-process coordinator for the module's runs (each run is a job of its own: tests/conftest.py)."""
    return module_address


def _resume(address: str, lengths: list[int], w1: int, k1: int, w2: int, k2: int, cut: int, stateful: bool = False,
            **packing: Any) -> tuple[dict[str, Any], Any]:
    """An epoch trained by `w1` ranks (`k1` workers) to `cut` batches, checkpointed, then finished by
    `w2` ranks (`k2` workers) from the state: the state and the token audit of the whole epoch."""
    docs, job = Docs(lengths), uuid.uuid4().hex
    first, states = run_world(address, job, docs, w1, k1, SEQ_LEN, cut, None, stateful, **packing)
    assert all(s == states[0] for s in states), "every rank gets the same state"
    rest, ends = run_world(address, job, docs, w2, k2, SEQ_LEN, None, states[0], stateful, **packing)
    assert ends[0]["waiting"] == [] and ends[0]["skip"] == [] and ends[0]["sampler"]["epoch"] == 1
    limit = SEQ_LEN if packing.get("long") == "truncate" else None
    return states[0], token_audit(lengths, [p for t in first + rest for p in t], limit)


_cases = st.fixed_dictionaries({
    "lengths": st.lists(st.integers(1, 3 * SEQ_LEN), min_size=1, max_size=24),
    "w1": st.integers(1, 3), "w2": st.integers(1, 3),
    "k1": st.sampled_from([0, 1, 2, 4]), "k2": st.sampled_from([0, 2]),
    "cut": st.integers(0, 8),
    "pack": st.sampled_from(["greedy", "best_fit"]), "buffer": st.integers(1, 6),
    "long": st.sampled_from(["split", "truncate"]), "rows": st.integers(1, 2),
})


def _check(address: str, c: dict[str, Any]) -> None:
    lengths, w1, w2, k1, k2, cut = c.pop("lengths"), c.pop("w1"), c.pop("w2"), c.pop("k1"), c.pop("k2"), c.pop("cut")
    state, bad = _resume(address, lengths, w1, k1, w2, k2, cut, **c)
    assert not bad, f"{dict(bad)} tokens; the state was {state}"


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_cases)
def test_every_token_is_trained_once_across_a_resume(address: str, case: dict[str, Any]) -> None:
    _check(address, case)


@pytest.mark.slow
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_cases)
def test_every_token_is_trained_once_across_a_resume_many(address: str, case: dict[str, Any]) -> None:
    _check(address, case)


def test_a_resume_on_another_world_takes_the_waiting_pieces_and_skips_what_was_past_the_cut(address: str) -> None:
    # Long documents, a buffer of 5: at the cut every rank holds pieces, and the ranks pulled different counts.
    lengths = [(i * 37) % 40 + 1 for i in range(30)]
    state, bad = _resume(address, lengths, 3, 2, 2, 0, 3, pack="best_fit", buffer=5)
    assert state["waiting"] and not bad, (state, bad)


def test_a_rank_that_trains_waiting_pieces_first_does_not_hold_the_others_at_the_join(address: str) -> None:
    """Rank 2 of the new world gets no waiting piece: its first batch joins the sampler's generation at once,
    and the join waits for every rank. Ranks 0 and 1 must join at their first batch too, before the batch
    of waiting pieces they train first, or the world deadlocks at its first all-reduce."""
    docs, job = Docs([SEQ_LEN] * 12), uuid.uuid4().hex
    _, states = run_world(address, job, docs, 1, 0, SEQ_LEN, 1, None, pack="best_fit", buffer=3)
    assert len(states[0]["waiting"]) == 2, states[0]
    run_world(address, job, docs, 3, 0, SEQ_LEN, 2, states[0], lockstep=True, pack="best_fit", buffer=1)


@pytest.mark.slow
@pytest.mark.parametrize(("stateful", "w1", "k1", "w2", "k2"), [(False, 2, 8, 3, 1), (True, 3, 4, 1, 8), (True, 1, 2, 2, 0)])
def test_eight_workers_and_the_stateful_data_loader(address: str, stateful: bool, w1: int, k1: int, w2: int, k2: int) -> None:
    lengths = [(i * 53) % 45 + 1 for i in range(60)]
    state, bad = _resume(address, lengths, w1, k1, w2, k2, 4, stateful, pack="best_fit", buffer=6, rows=2)
    assert state["waiting"] and not bad, (state, bad)


@pytest.mark.slow
def test_the_default_collective_is_torch_distributed(address: str, tmp_path: Path) -> None:
    """Two processes joined by torch.distributed (gloo) checkpoint with no gather= given: both get the same
    state, and a world of one finishes the epoch from it, every token once."""
    lengths = [(i * 31) % 40 + 1 for i in range(40)]
    job = uuid.uuid4().hex
    script = Path(__file__).resolve().parents[1] / "_packing_rank.py"
    procs = [subprocess.Popen([sys.executable, str(script), address, job, str(r), "2", str(tmp_path / "init"),
                               str(tmp_path / f"{r}.jsonl"), json.dumps(lengths), "--steps", "3"]) for r in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    out = [[json.loads(line) for line in (tmp_path / f"{r}.jsonl").read_text().splitlines()] for r in range(2)]
    states = [o[-1]["state"] for o in out]
    assert states[0] == states[1] and states[0]["waiting"]
    rest, _ = run_world(address, job, Docs(lengths), 1, 0, SEQ_LEN, None, states[0], pack="best_fit", buffer=4)
    trained = [tuple(p) for o in out for line in o[:-1] for p in line["pieces"]] + rest[0]
    assert not token_audit(lengths, trained, None)


def test_dynamic_dealing_resumes_exactly(address: str) -> None:
    lengths = [(i * 41) % 40 + 1 for i in range(36)]
    docs, job, args = Docs(lengths), uuid.uuid4().hex, {"dealing": "dynamic"}
    first, states = run_world(address, job, docs, 2, 0, SEQ_LEN, 4, None, sampler_args=args, pack="best_fit", buffer=3)
    rest, _ = run_world(address, job, docs, 3, 0, SEQ_LEN, None, states[0], sampler_args=args, pack="best_fit", buffer=3)
    assert states[0]["waiting"] and not token_audit(lengths, [p for t in first + rest for p in t], None)


def test_a_mixture_resumed_trains_what_an_uninterrupted_run_trains(address: str) -> None:
    """A mixture's epoch may take a document twice or not at all: the resumed run's tokens are the
    uninterrupted run's, as a multiset."""
    lengths = [(i * 23) % 40 + 1 for i in range(30)]
    docs, job, args = Docs(lengths), uuid.uuid4().hex, {"weights": [0.7, 0.3], "sources": [15, 15]}
    whole, _ = run_world(address, uuid.uuid4().hex, docs, 1, 0, SEQ_LEN, None, None, sampler_args=args, pack="best_fit",
                         buffer=3)
    first, states = run_world(address, job, docs, 3, 0, SEQ_LEN, 4, None, sampler_args=args, pack="best_fit", buffer=3)
    rest, _ = run_world(address, job, docs, 2, 0, SEQ_LEN, None, states[0], sampler_args=args, pack="best_fit", buffer=3)

    def tokens(pieces: list[tuple[int, int, int]]) -> Counter[tuple[int, int]]:
        return Counter((i, t) for i, o, n in pieces for t in range(o, o + n))

    assert states[0]["skip"] and tokens([p for t in first + rest for p in t]) == tokens(whole[0])


def _naive_state(pl: PackedLoader) -> dict[str, Any]:
    """What a packing loop as people write it saves: the sampler's state at what the packer pulled, no buffer."""
    run = pl._run
    assert run is not None
    return {"version": 1, "epoch": run.epoch, "sampler": pl.sampler.state_dict(consumed=run.pulled), "waiting": [],
            "skip": []}


def test_counting_the_buffer_as_consumed_loses_its_tokens(address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The peers' failure, on the same run: with the waiting pieces counted as consumed and not carried,
    the resumed epoch misses them (the check above catches this)."""
    lengths = [(i * 37) % 40 + 1 for i in range(30)]
    monkeypatch.setattr(PackedLoader, "state_dict", lambda self, step=None: _naive_state(self))
    state, bad = _resume(address, lengths, 1, 2, 1, 0, 3, pack="best_fit", buffer=5)
    assert bad["missing"] > 0 and bad["repeated"] == 0, bad


def test_stateful_data_loader_and_batches_of_samples(address: str) -> None:
    """torchdata's StatefulDataLoader (its own state not used) yielding lists of samples (collate_fn=list)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    lengths = [(i * 13) % 30 + 1 for i in range(40)]
    docs, job, trained = Docs(lengths), uuid.uuid4().hex, []

    def packed() -> PackedLoader:
        s = DistributedSampler(len(docs), num_replicas=1, rank=0, address=address, job=job, tail="uneven")
        dl = StatefulDataLoader(Indexed(docs), batch_size=3, sampler=s, collate_fn=list, num_workers=0)
        return PackedLoader(dl, s, SEQ_LEN, pack="best_fit", buffer=4, rows=2)

    pl = packed()
    for k, b in enumerate(pl):
        assert b.tokens.shape == (2, SEQ_LEN)
        trained += [p for row in b.pieces for p in row]
        if k == 3:
            break
    state = pl.state_dict()
    pl.sampler.close()
    pl = packed()
    pl.load_state_dict(state)
    trained += [p for b in pl for row in b.pieces for p in row]
    pl.sampler.close()
    assert not token_audit(lengths, trained, None)


def test_a_loop_that_stops_and_iterates_again_goes_on_with_the_epoch(address: str) -> None:
    """The loader's two workers hold samples read ahead when the loop stops: iterating again must not
    start a new iterator of the loader, which would never see them."""
    lengths = [(i * 29) % 40 + 1 for i in range(40)]
    docs = Docs(lengths)
    s = DistributedSampler(len(docs), num_replicas=1, rank=0, address=address, job=uuid.uuid4().hex, tail="uneven")
    dl = DataLoader(Indexed(docs), batch_size=None, sampler=s, num_workers=2, multiprocessing_context=CONTEXT)
    pl = PackedLoader(dl, s, SEQ_LEN, pack="best_fit", buffer=4)
    trained = []
    for k, b in enumerate(pl):
        trained += [p for row in b.pieces for p in row]
        if k == 2:
            break
    trained += [p for b in pl for row in b.pieces for p in row]
    s.close()
    assert not token_audit(lengths, trained, None)


def test_the_packed_loader_checks_what_it_is_given(address: str) -> None:
    s = DistributedSampler(10, num_replicas=1, rank=0, address=address, job=uuid.uuid4().hex)
    dl = DataLoader(Indexed(Docs([3] * 10)), batch_size=None, sampler=s)
    with pytest.raises(TypeError, match="sampler must be a croupier.client.DistributedSampler"):
        PackedLoader(dl, object(), 8)  # type: ignore[arg-type]
    other = DistributedSampler(10, num_replicas=1, rank=0, address=address, job=uuid.uuid4().hex)
    with pytest.raises(ValueError, match=r"the loader's sampler \(DistributedSampler\) is not the sampler given"):
        PackedLoader(dl, other, 8)
    with pytest.raises(ValueError, match=r"long must be one of \['split', 'truncate'\] \(got long='drop'\)"):
        PackedLoader(dl, s, 8, long="drop")
    with pytest.raises(ValueError, match=r"rows must be >= 1"):
        PackedLoader(dl, s, 8, rows=0)
    plain = DataLoader(Docs([3] * 10), batch_size=None, sampler=s)  # the index is not carried
    with pytest.raises(TypeError, match=r"must yield \(index, tokens\) samples, or lists of them \(collate_fn=list\); got Tensor"):
        next(iter(PackedLoader(plain, s, 8)))
    pl = PackedLoader(dl, s, 8)
    with pytest.raises(ValueError, match=r"a waiting piece is \[index >= 0, offset >= 0, length >= 1\] \(got \[1, 2\]\)"):
        pl.load_state_dict({"version": 1, "epoch": 0, "sampler": {}, "waiting": [[1, 2]], "skip": []})
    assert pl._loaded is None  # nothing changed
    floats = DataLoader(list(enumerate([torch.ones(3)] * 10)), batch_size=None, sampler=s)
    with pytest.raises(TypeError, match=r"the tokens of sample \d must be a 1-D sequence of integer tokens"):
        next(iter(PackedLoader(floats, s, 8)))
    s.close()
    other.close()


def test_a_world_of_several_needs_a_gather(address: str) -> None:
    s = DistributedSampler(10, num_replicas=2, rank=1, address=address, job=uuid.uuid4().hex)
    pl = PackedLoader(DataLoader(Indexed(Docs([3] * 10)), batch_size=None, sampler=s), s, 8)
    with pytest.raises(RuntimeError, match=r"gathers them from the 2 ranks: call it on every rank after init_process_group"):
        pl.state_dict()
