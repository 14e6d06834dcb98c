"""The packing core (client/_packing.py, client/_pack_state.py): planners, a batch's tensors, the merge of ranks' parts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from croupier.client._pack_state import Part, from_state, merge, share, to_state
from croupier.client._packing import BestFit, Greedy, Piece, assemble, make_planner, pieces_of


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 70), max_size=40), st.integers(1, 32), st.integers(1, 9),
       st.sampled_from(["greedy", "best_fit"]), st.sampled_from(["split", "truncate"]))
def test_every_piece_goes_into_one_row_or_waits(lengths: list[int], seq_len: int, buffer: int, pack: str, long: str) -> None:
    pieces = [piece for i, n in enumerate(lengths) for piece in pieces_of(i, n, seq_len, long)]
    p = make_planner(pack, seq_len, buffer)
    rows = [r for piece in pieces for r in p.add(piece)]
    waiting = p.waiting()
    assert sorted([x.key for r in rows for x in r] + [x.key for x in waiting]) == sorted(x.key for x in pieces)
    assert all(sum(x.length for x in r) <= seq_len and r for r in rows)
    if pack == "best_fit":
        assert len(waiting) < buffer
    rows += p.flush()
    assert p.waiting() == []
    assert sorted(x.key for r in rows for x in r) == sorted(x.key for x in pieces)
    # the pieces of a document: `split` covers it whole, `truncate` its first seq_len tokens
    for i, n in enumerate(lengths):
        mine = sorted((x.offset, x.length) for x in pieces if x.index == i)
        covered = [t for o, m in mine for t in range(o, o + m)]
        assert covered == list(range(n if long == "split" else min(n, seq_len)))


def test_greedy_keeps_the_order_and_closes_a_row_on_a_piece_that_does_not_fit() -> None:
    g = Greedy(10)
    out = [g.add(Piece(i, 0, n)) for i, n in enumerate([4, 5, 3, 7, 3])]
    assert out[0] == out[1] == [] and [[x.index for x in r] for r in out[2]] == [[0, 1]]
    assert [[x.index for x in r] for r in out[3]] == [[2, 3]] and out[4] == []  # 3 + 7 fill the row exactly
    assert [x.index for x in g.waiting()] == [4]


def test_best_fit_opens_with_the_oldest_and_fills_with_the_longest_that_fits() -> None:
    b = BestFit(10, 4)
    for i, n in enumerate([6, 5, 4, 3]):
        rows = b.add(Piece(i, 0, n))
    assert [[x.index for x in r] for r in rows] == [[0, 2]]  # 6 + 4 (5 does not fit; 4 is the longest that does)
    assert [x.index for x in b.waiting()] == [1, 3]
    assert [[x.index for x in r] for r in b.flush()] == [[1, 3]]


def test_best_fit_pads_less_than_greedy_on_mixed_lengths() -> None:
    lengths = [(i * 7919) % 60 + 1 for i in range(500)]
    pad = {}
    for pack in ("greedy", "best_fit"):
        p = make_planner(pack, 64, 32)
        rows = [r for i, n in enumerate(lengths) for r in p.add(Piece(i, 0, n))] + p.flush()
        pad[pack] = len(rows) * 64 - sum(lengths)
    assert pad["best_fit"] < pad["greedy"] / 2, pad


def test_split_and_truncate_cut_a_long_document() -> None:
    doc = torch.arange(25)
    split = pieces_of(7, doc, 10, "split")
    assert [p.key for p in split] == [(7, 0, 10), (7, 10, 10), (7, 20, 5)]
    assert torch.equal(split[2].tokens, torch.arange(20, 25))  # type: ignore[arg-type]
    assert [p.key for p in pieces_of(7, doc, 10, "truncate")] == [(7, 0, 10)]
    assert [p.key for p in pieces_of(7, 10, 10, "split")] == [(7, 0, 10)]


def test_a_batch_names_its_documents_for_varlen_attention() -> None:
    rows = [(Piece(3, 0, 2, torch.tensor([30, 31])), Piece(4, 5, 3, torch.tensor([45, 46, 47]))),
            (Piece(5, 0, 6, torch.arange(6)),)]
    b = assemble(rows, 6, -1)
    assert b.tokens.tolist() == [[30, 31, 45, 46, 47, -1], [0, 1, 2, 3, 4, 5]]
    assert b.position_ids.tolist() == [[0, 1, 5, 6, 7, 0], [0, 1, 2, 3, 4, 5]]  # a split piece goes on from its offset
    assert b.cu_seqlens.dtype == torch.int32 and b.cu_seqlens.tolist() == [0, 2, 5, 6, 12]
    assert b.max_seqlen == 6 and b.padding == 1 and len(b) == 2
    assert b.pieces == (((3, 0, 2), (4, 5, 3)), ((5, 0, 6),))


@pytest.mark.parametrize(("args", "error", "match"), [
    (("tight", 8, 4), ValueError, r"pack must be one of \('greedy', 'best_fit'\) \(got pack='tight'\)"),
    (("greedy", 0, 4), ValueError, r"seq_len must be >= 1"),
    (("best_fit", 8, 0), ValueError, r"buffer must be >= 1"),
    (("greedy", 8.0, 4), TypeError, r"seq_len must be an int"),
])
def test_bad_planner_settings_are_refused(args: tuple[object, ...], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make_planner(*args)  # type: ignore[arg-type]


def test_merge_cuts_at_the_fewest_and_skips_what_was_taken_past_it() -> None:
    parts = [Part(0, 2, 7, False, (11, 12, 13), (), ((12, 0, 4),)),  # items 4..6 logged
             Part(1, 2, 5, False, (21,), (), ((21, 8, 8), (21, 16, 3)))]
    m = merge(parts, [])
    assert m.cut == 5 and not m.done
    assert m.skip == (12, 13)  # rank 0's items 5 and 6: 12 is waiting, 13 trained; both are dealt again
    assert m.waiting == ((12, 0, 4), (21, 8, 8), (21, 16, 3))
    # a loaded skip entry met (a hit) is gone; one met past the cut stays, once
    m2 = merge([Part(0, 2, 9, False, (40, 41), (40, 41), ()), Part(1, 2, 8, False, (), (50,), ())], [40, 41, 50, 60])
    assert m2.cut == 8 and m2.skip == (41, 60)
    assert merge([Part(0, 2, 9, True, (3,)), Part(1, 2, 8, True)], [3]).skip == ()  # every rank is through


@pytest.mark.parametrize(("parts", "match"), [
    ([], r"needs every rank's part \(got none\)"),
    ([Part(0, 1, 3, False), Part(2, 1, 3, False)], r"one part from each rank 0..1 \(got ranks \[0, 2\]\)"),
    ([Part(0, 1, 3, False), Part(1, 2, 3, False)], r"different epochs \[1, 2\]"),
    ([Part(0, 1, 9, False, (5,)), Part(1, 1, 3, False)], r"rank 0 logged its items from 8 on, after the cut at 3"),
])
def test_merge_refuses_parts_that_are_not_one_world(parts: list[Part], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        merge(parts, [])


def test_a_new_world_shares_the_waiting_pieces_out_once() -> None:
    waiting = [(i, 0, 1) for i in range(7)]
    for world in (1, 2, 3, 8):
        shares = [share(waiting, world, r) for r in range(world)]
        assert sorted(k for s in shares for k in s) == waiting


@pytest.mark.parametrize(("state", "error", "match"), [
    ([1], TypeError, r"must be a dict \(got list\)"),
    ({"version": 1}, ValueError, r"has the keys \['epoch', 'sampler', 'skip', 'version', 'waiting'\] \(got \['version'\]\)"),
    ({"version": 9, "epoch": 0, "sampler": {}, "waiting": [], "skip": []}, ValueError, r"version 9 is not one this release reads"),
    ({"version": 1, "epoch": -1, "sampler": {}, "waiting": [], "skip": []}, ValueError, r"epoch must be >= 0 \(got the packed state's epoch=-1\)"),
    ({"version": 1, "epoch": 0, "sampler": 3, "waiting": [], "skip": []}, ValueError, r"sampler must be a sampler's state dict \(got 3\)"),
    ({"version": 1, "epoch": 0, "sampler": {}, "waiting": [[1, 0, 0]], "skip": []}, ValueError, r"a waiting piece's length must be >= 1 \(got a waiting piece's length=0\)"),
    ({"version": 1, "epoch": 0, "sampler": {}, "waiting": [], "skip": [-1]}, ValueError, r"indices >= 0 \(got \[-1\]\)"),
])
def test_malformed_packed_states_are_refused(state: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        from_state(state)  # type: ignore[arg-type]


def test_a_state_reads_back() -> None:
    m = merge([Part(0, 0, 4, False, (9,), (), ((9, 2, 3),))], [])
    state = to_state({"epoch": 0}, m)
    assert from_state(state) == (0, {"epoch": 0}, [(9, 2, 3)], [])
    assert from_state({}) == (None, {}, [], [])
