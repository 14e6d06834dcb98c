"""croupier.core.amend: weights changed, sources grown and samples skipped mid-run, each source epoch still exactly once."""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from croupier.core import feistel
from croupier.core.amend import Amendment, check, sizes_after, skip_of
from croupier.core.mixture import PARTS, parts_of
from croupier.core.stream import Stream
from tests._budget import examples

LENGTH = 1500  # stream positions dealt per example


@st.composite
def amended_streams(draw: st.DrawFn) -> Stream:
    """A stream of 1 to 4 sources with up to 5 amendments (weights, grows, skips) at increasing positions."""
    k = draw(st.integers(1, 4))
    sizes = tuple(draw(st.lists(st.integers(1, 30), min_size=k, max_size=k)))
    parts = parts_of(draw(st.lists(st.floats(0.05, 1.0), min_size=k, max_size=k)))
    shuffle = draw(st.booleans())
    amendments: list[Amendment] = []
    at = 0
    for _ in range(draw(st.integers(0, 5))):
        at += draw(st.integers(0, 400))
        kind = draw(st.sampled_from(["weights", "grow", "skip", "skip"]))
        now = sizes_after(sizes, amendments)
        if kind == "weights":
            a = Amendment("weights", parts_of(draw(st.lists(st.floats(0.05, 1.0), min_size=k, max_size=k))))
        elif kind == "grow":
            s = draw(st.integers(0, k - 1))
            a = Amendment("grow", (s, now[s], now[s] + draw(st.integers(1, 20))))
        else:
            space = sum(now)
            idx = draw(st.lists(st.integers(0, space - 1), min_size=1, max_size=6, unique=True))
            try:
                a = skip_of(idx, sizes, amendments, now)  # every amendment drawn holds
            except ValueError:  # already skipped, or a source left empty: drawn again by the next example
                continue
        amendments.append(Amendment(a.kind, a.values, at))
    return Stream(sizes, ((0, parts),), (), draw(st.integers(0, 2**32)), shuffle, tuple(amendments))


def _dealt(stream: Stream, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    index, source, epoch = stream.indices(np.arange(length))
    offsets = stream.offsets
    return index - offsets[source], source, epoch


@settings(max_examples=examples(300), deadline=None)
@given(amended_streams())
def test_every_source_epoch_deals_each_sample_not_skipped_exactly_once(stream: Stream) -> None:
    sample, source, epoch = _dealt(stream, LENGTH)
    by_epoch: dict[tuple[int, int], list[int]] = defaultdict(list)
    for j, s, e in zip(sample.tolist(), source.tolist(), epoch.tolist()):
        by_epoch[(s, e)].append(j)
    skips = {(s, j): a.at for a in stream.amendments if a.kind == "skip" for s, j in a.pairs}
    for (s, e), got in by_epoch.items():
        twice = [j for j, c in Counter(got).items() if c > 1]
        assert not twice, f"source {s} epoch {e} dealt {twice} twice"
        line = stream.timeline(s)
        if line.epoch_start(e + 1) <= stream.dealt_before(LENGTH)[s]:  # the whole source epoch was dealt
            dealt, domain = line.epoch_sizes(e)
            assert len(got) == dealt
            missing = set(range(domain)) - set(got)
            assert all((s, j) in skips for j in missing), f"source {s} epoch {e} left out {sorted(missing)}"
            assert len(missing) == domain - dealt
    # A skipped sample is never dealt from its position on.
    for p, (j, s) in enumerate(zip(sample.tolist(), source.tolist())):
        at = skips.get((s, j))
        assert at is None or p < at, f"sample {j} of source {s} dealt at {p}, skipped from {at}"


@settings(max_examples=examples(60), deadline=None)
@given(amended_streams(), st.integers(0, LENGTH - 1))
def test_random_access_agrees_with_dealing_from_the_start(stream: Stream, p: int) -> None:
    whole = stream.indices(np.arange(LENGTH))
    one = stream.indices(np.array([p, LENGTH - 1 - p]))
    for a, b in zip(whole, one):
        assert a[[p, LENGTH - 1 - p]].tolist() == b.tolist()


@settings(max_examples=examples(60), deadline=None)
@given(amended_streams())
def test_the_stream_before_an_amendment_is_the_stream_without_it(stream: Stream) -> None:
    if not stream.amendments:
        return
    first = stream.amendments[0].at
    assert first is not None
    plain = Stream(stream.sizes, stream.changes, stream.max_epochs, stream.seed, stream.shuffle)
    n = min(first, LENGTH)
    a, b = stream.indices(np.arange(n)), plain.indices(np.arange(n))
    # The same sources and samples; indices may be numbered on grown sizes (the offsets).
    assert a[1].tolist() == b[1].tolist() and a[2].tolist() == b[2].tolist()
    assert (a[0] - stream.offsets[a[1]]).tolist() == (b[0] - plain.offsets[b[1]]).tolist()


def test_a_grown_source_finishes_its_epoch_in_progress_then_deals_its_new_size() -> None:
    # One source of 10: a grow to 15 at position 4 (mid epoch 0): epoch 0 keeps its 10, epoch 1 has 15.
    s = Stream((10,), ((0, (PARTS,)),), (), 3, True, (Amendment("grow", (0, 10, 15), 4),))
    _, source, epoch = s.indices(np.arange(40))
    sample = s.indices(np.arange(40))[0]
    assert sorted(sample[:10].tolist()) == list(range(10)) and set(epoch[:10].tolist()) == {0}
    assert sorted(sample[10:25].tolist()) == list(range(15)) and set(epoch[10:25].tolist()) == {1}
    # At the very start of an epoch the grow holds at once.
    t = Stream((10,), ((0, (PARTS,)),), (), 3, True, (Amendment("grow", (0, 10, 15), 10),))
    assert sorted(t.indices(np.arange(10, 25))[0].tolist()) == list(range(15))


def test_a_skip_holds_in_the_epoch_in_progress() -> None:
    plain = Stream((20,), ((0, (PARTS,)),), (), 5, True)
    order = plain.indices(np.arange(20))[0].tolist()
    late = order[15]  # dealt at position 15 without the skip
    s = Stream((20,), ((0, (PARTS,)),), (), 5, True, (Amendment("skip", (0, late), 10),))
    got = s.indices(np.arange(40))[0].tolist()
    assert got[:10] == order[:10]
    assert late not in got[:19] and sorted(got[:19]) == sorted(set(range(20)) - {late})
    assert got[19:38].count(late) == 0 and len(set(got[19:38])) == 19  # the next epochs deal 19


def test_weights_amended_replace_the_rest_of_the_schedule() -> None:
    sched = ((0, parts_of([1, 1])), (100, parts_of([1, 3])))
    s = Stream((50, 50), sched, (), 0, True, (Amendment("weights", parts_of([3, 1]), 60),))
    src = s.indices(np.arange(400))[1]
    assert abs(int((src[60:400] == 0).sum()) - 255) <= 1  # 3:1 from 60 on, the schedule's 1:3 at 100 dropped


def test_a_capped_source_counts_its_epochs_as_amended() -> None:
    # Source 0 capped at 1 epoch; 2 of its 10 samples skipped before it starts: it deals 8, then stops.
    pairs = (0, 1, 0, 2)
    s = Stream((10, 100), ((0, parts_of([1, 1])),), (1, 0), 0, True, (Amendment("skip", pairs, 0),))
    src = s.indices(np.arange(200))[1]
    assert int((src == 0).sum()) == 8


def test_feistel_unpermute_inverts_permute() -> None:
    for n in (2, 3, 7, 8, 9, 1023, 1024, 1025, 65537):
        keys = feistel.round_keys(feistel.derive_key(n, 1))
        p = feistel.permute(np.arange(n), n, keys)
        assert feistel.unpermute(p, n, keys).tolist() == list(range(n))


@pytest.mark.parametrize("new, why", [
    (Amendment("weights", (1, 2)), "adding up to"),
    (Amendment("grow", (0, 9, 20)), "has 10 samples, not 9"),
    (Amendment("grow", (0, 10, 10)), "only grows"),
    (Amendment("grow", (5, 10, 20)), "names a source"),
    (Amendment("skip", (0, 10)), "source 0 has no sample 10"),
    (Amendment("skip", (1, 3, 0, 1)), "sorted and distinct"),
    (Amendment("skip", (0, 1)), "skipped already"),
    (Amendment("skip", tuple(x for j in range(2, 10) for x in (0, j))), "none to deal"),
])
def test_bad_amendments_are_refused_by_name(new: Amendment, why: str) -> None:
    before = [Amendment("skip", (0, 0, 0, 1), 0)]
    with pytest.raises(ValueError, match=why):
        check((10, 20), before, new, PARTS)


def test_skip_reads_indices_in_the_numbering_given_and_a_pending_grow_renumbers_nothing() -> None:
    before = [Amendment("grow", (0, 10, 15), None)]
    # Pending: the ranks still hand out sources of (10, 20), so index 14 is source 1's sample 4.
    assert skip_of([14, 15], (10, 20), before, (10, 20)).pairs == [(1, 4), (1, 5)]
    # Held: numbered as a ConcatDataset of the grown sources (15, 20).
    assert skip_of([14, 15], (10, 20), before, (15, 20)).pairs == [(0, 14), (1, 0)]
    with pytest.raises(ValueError, match=r"index 35 is not in the dataset: indices are in \[0, 35\) \(sources of 15, 20"):
        skip_of([35], (10, 20), before, (15, 20))
    with pytest.raises(ValueError, match=r"numbered by sources of sizes \[16, 20\] are not the job's \(sizes \[15, 20\]\)"):
        skip_of([1], (10, 20), before, (16, 20))
    assert sizes_after((10, 20), before) == (15, 20)


def test_a_skip_describes_the_source_and_sample_of_each_pair() -> None:
    assert Amendment("skip", (2, 40)).describe() == "skip 1 samples, (source, sample) (2, 40) (pending)"
    many = Amendment("skip", tuple(x for j in range(10) for x in (0, j)), 7)
    assert many.describe() == ("skip 10 samples, (source, sample) (0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5), "
                               "(0, 6), (0, 7) and 2 more (from position 7)")


def test_an_amendment_round_trips_and_bad_lists_are_refused() -> None:
    a = Amendment("skip", (0, 3), 7)
    assert Amendment.from_list(a.to_list()) == a
    for bad, why in [([1, 2], "must be"), (["drop", [], None], "kind"), (["grow", [1.5], None], "ints"),
                     (["grow", [1], -1], "position")]:
        with pytest.raises(ValueError, match=why):
            Amendment.from_list(bad)


def test_weights_for_another_number_of_sources_name_both_counts() -> None:
    for weights in ([1, 2, 3], [5]):
        with pytest.raises(ValueError, match=rf"^the job has 2 sources; {len(weights)} weights given$"):
            check([10, 20], [], Amendment("weights", parts_of(weights), None), PARTS)
