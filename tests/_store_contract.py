"""The store contract: what every backend MUST do, as tests a subclass per backend runs (tests/server/test_store.py, tests/server/test_store_pg.py)."""

from __future__ import annotations

import os
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from croupier.server._store import (
    Recovered,
    Store,
    StoreConflict,
    StoreUnavailable,
)
from tests._budget import examples


def _payload(tag: int) -> bytes:
    """A distinct payload for ``tag``, with NUL and high bytes in it."""
    return b"\x00rec\xff" + tag.to_bytes(8, "little") + bytes(tag % 7)


class StoreContract:
    """What every backend MUST do; a subclass per backend says how to open and reopen one.

    Reopening stands for a coordinator restart: a file or database store is closed and opened
    again from its URL; the memory store lives as long as its process, so it is handed back as
    it is.
    """

    def _open(self, tmp: Path) -> Store:
        raise NotImplementedError

    def _reopen(self, store: Store) -> Store:
        raise NotImplementedError

    def margin(self, store: Store) -> int:
        """How many records before its snapshot a store keeps (0: a single-writer store prunes them all)."""
        return 0

    @pytest.fixture(autouse=True)
    def _close_all(self) -> Iterator[None]:
        self._opened: list[Store] = []
        yield
        for s in self._opened:
            s.close()

    def open(self, tmp: Path) -> Store:
        """Opens a new, empty store whose files (if any) go under ``tmp``; closed after the test."""
        s = self._open(tmp)
        self._opened.append(s)
        return s

    def reopen(self, store: Store) -> Store:
        """What a restarted coordinator would open in place of ``store``; closed after the test."""
        s = self._reopen(store)
        self._opened.append(s)
        return s

    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return self.open(tmp_path)

    def test_is_a_store(self, store: Store) -> None:
        assert isinstance(store, Store)
        assert isinstance(store.url, str)
        assert isinstance(store.shared, bool)

    def test_empty_store_loads_nothing(self, store: Store) -> None:
        assert store.load() == Recovered(None, 0, [])
        assert store.read_since(0) == Recovered(None, 0, [])
        assert store.last_seq() == 0
        assert self.reopen(store).load() == Recovered(None, 0, [])

    def test_append_round_trips(self, store: Store) -> None:
        assert store.append([b"first"]) == 1
        # Other bytes-like records are taken too, and read back as bytes.
        assert store.append([b"", b"\x00\xff" * 3, bytearray(b"ba")]) == 4  # type: ignore[list-item]
        big = os.urandom(1 << 20)
        assert store.append([memoryview(big)]) == 5  # type: ignore[list-item]
        expected = [(1, b"first"), (2, b""), (3, b"\x00\xff" * 3), (4, b"ba"), (5, big)]
        assert store.load() == Recovered(None, 0, expected)
        store = self.reopen(store)
        assert store.load() == Recovered(None, 0, expected)
        assert all(type(p) is bytes for _, p in store.load().records)
        assert all(type(p) is bytes for _, p in store.read_since(0).records)

    def test_sequences_are_contiguous(self, store: Store) -> None:
        rng = random.Random(0)
        last = 0
        for i in range(100):
            k = rng.randint(1, 5)
            got = store.append([_payload(i)] * k) if i % 2 else store.append_at(last, [_payload(i)] * k)
            assert got == last + k
            last = got
        seqs = [s for s, _ in store.load().records]
        assert seqs == list(range(1, last + 1))
        assert store.last_seq() == last

    def test_numbering_continues_after_reopen(self, store: Store) -> None:
        store.append([b"a", b"b"])
        store = self.reopen(store)
        assert store.last_seq() == 2
        assert store.append([b"c"]) == 3
        assert store.append_at(3, [b"d"]) == 4
        assert store.load().records == [(1, b"a"), (2, b"b"), (3, b"c"), (4, b"d")]

    def test_snapshot_prunes_and_load_returns_only_later_records(self, store: Store) -> None:
        for i in range(10):
            store.append([_payload(i)])
        store.write_snapshot(6, b"state@6")
        want = Recovered(b"state@6", 6, [(s, _payload(s - 1)) for s in range(7, 11)])
        assert store.load() == want
        assert store.append([b"after"]) == 11
        store = self.reopen(store)
        got = store.load()
        assert (got.snapshot, got.snapshot_seq) == (b"state@6", 6)
        assert got.records == [*want.records, (11, b"after")]
        assert got.last_seq == 11

    def test_newer_snapshot_replaces_older(self, store: Store) -> None:
        store.append([b"a", b"b", b"c"])
        store.write_snapshot(1, b"s1")
        store.write_snapshot(1, b"s1 again")  # replaces on a single-writer store, ignored on a shared one
        assert store.load().snapshot == (b"s1" if store.shared else b"s1 again")
        store.write_snapshot(3, b"s3")
        got = self.reopen(store).load()
        assert got == Recovered(b"s3", 3, [])
        assert got.last_seq == 3

    def test_snapshot_of_everything_then_append(self, store: Store) -> None:
        store.append([b"a", b"b"])
        store.write_snapshot(2, b"all")
        assert store.load() == Recovered(b"all", 2, [])
        assert store.last_seq() == 2
        assert store.append([b"c"]) == 3
        assert self.reopen(store).load() == Recovered(b"all", 2, [(3, b"c")])

    def test_snapshot_of_empty_store(self, store: Store) -> None:
        store.write_snapshot(0, b"")
        assert store.load() == Recovered(b"", 0, [])
        assert store.last_seq() == 0
        assert store.append([b"x"]) == 1

    def test_snapshot_seq_is_checked(self, store: Store) -> None:
        store.append([b"a", b"b", b"c"])
        with pytest.raises(ValueError, match=r"<= the last acknowledged record 3 \(got seq=4\)"):
            store.write_snapshot(4, b"s")
        with pytest.raises(ValueError, match=r">= 0 \(got seq=-1\)"):
            store.write_snapshot(-1, b"s")
        store.write_snapshot(2, b"s")
        if store.shared:  # another replica may have written a newer one: not an error
            store.write_snapshot(1, b"older")
        else:
            with pytest.raises(ValueError, match=r">= the current snapshot's 2 \(got seq=1\)"):
                store.write_snapshot(1, b"s")
        with pytest.raises(TypeError, match="seq must be an int"):
            store.write_snapshot(True, b"s")
        with pytest.raises(TypeError, match="payload must be bytes"):
            store.write_snapshot(2, "s")  # type: ignore[arg-type]
        assert store.load() == Recovered(b"s", 2, [(3, b"c")])

    def test_append_arguments_are_checked(self, store: Store) -> None:
        with pytest.raises(ValueError, match="at least one record"):
            store.append([])
        with pytest.raises(TypeError, match=r"records\[1\] must be bytes \(got str\)"):
            store.append([b"ok", "no"])  # type: ignore[list-item]
        with pytest.raises(TypeError, match="not a single bytes"):
            store.append(b"abc")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="at least one record"):
            store.append_at(0, [])
        with pytest.raises(TypeError, match="not a single bytes"):
            store.append_at(0, b"abc")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"expected_last must be an int \(got expected_last=False\)"):
            store.append_at(False, [b"x"])
        with pytest.raises(TypeError, match=r"expected_last must be an int \(got expected_last='0'\)"):
            store.append_at("0", [b"x"])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"expected_last must be >= 0 \(got expected_last=-1\)"):
            store.append_at(-1, [b"x"])
        assert store.load() == Recovered(None, 0, [])
        assert store.append([b"x"]) == 1

    def test_append_at_appends_only_at_the_journals_end(self, store: Store) -> None:
        assert store.append_at(0, [b"a", b"b"]) == 2
        assert store.append_at(2, [b"c"]) == 3
        for stale in (0, 1, 2):
            with pytest.raises(StoreConflict, match=f"at record 3, past expected_last {stale}|appended record {stale + 1} first"):
                store.append_at(stale, [b"lost"])
        with pytest.raises(ValueError, match="expected_last 4 is beyond the journal's last record 3") as info:
            store.append_at(4, [b"gap"])
        assert store.url in str(info.value)
        want = [(1, b"a"), (2, b"b"), (3, b"c")]
        assert store.load() == Recovered(None, 0, want)  # nothing from the refused calls
        store.write_snapshot(3, b"s3")  # the journal's end is the snapshot's, even with every record pruned
        assert store.last_seq() == 3
        with pytest.raises(StoreConflict):
            store.append_at(2, [b"lost"])
        assert store.append_at(3, [b"d"]) == 4
        store = self.reopen(store)
        with pytest.raises(StoreConflict):
            store.append_at(3, [b"lost"])
        assert store.append_at(4, [b"e", b"f"]) == 6
        assert store.load() == Recovered(b"s3", 3, [(4, b"d"), (5, b"e"), (6, b"f")])

    def test_read_since(self, store: Store) -> None:
        assert store.append([_payload(i) for i in range(1, 11)]) == 10
        everything = [(s, _payload(s)) for s in range(1, 11)]
        for x in (0, 3, 9, 10):
            assert store.read_since(x) == Recovered(None, x, everything[x:])
        store.write_snapshot(8, b"s8")
        margin = self.margin(store)
        for x in range(11):
            got = store.read_since(x)
            if x >= 8 or x + 1 > 8 - margin:  # record x + 1 is still held: catch up by records
                assert got == Recovered(None, x, everything[x:]), x
            else:  # pruned: start again from the snapshot
                assert got == Recovered(b"s8", 8, everything[8:]), x
                assert got == store.load()
        store = self.reopen(store)
        assert store.read_since(10) == Recovered(None, 10, [])
        assert store.read_since(0) == (store.load() if margin < 8 else Recovered(None, 0, everything))

    def test_read_since_arguments_are_checked(self, store: Store) -> None:
        store.append([b"a", b"b"])
        with pytest.raises(ValueError, match=r"seq must be .*\(got seq=-1\)"):
            store.read_since(-1)
        with pytest.raises(ValueError, match=r"seq must be in \[0, 2\], the journal's last record \(got seq=3\)"):
            store.read_since(3)
        with pytest.raises(TypeError, match=r"seq must be an int \(got seq=True\)"):
            store.read_since(True)
        with pytest.raises(TypeError, match=r"seq must be an int \(got seq=1.0\)"):
            store.read_since(1.0)  # type: ignore[arg-type]

    def test_has_room_before_any_full_write_and_once_closed(self, tmp_path: Path) -> None:
        """Every backend keeps the whole protocol, has_room included: True until a write found no room."""
        store = self.open(tmp_path)
        assert isinstance(store, Store)
        assert store.has_room() is True
        store.append([b"x"])
        store.write_snapshot(1, b"s")
        assert store.has_room() is True
        store.close()
        assert store.has_room() is True  # answers, and does not raise, on a closed store

    def test_closed_store_refuses(self, tmp_path: Path) -> None:
        store = self.open(tmp_path)
        store.append([b"x"])
        store.close()
        store.close()
        with pytest.raises(StoreUnavailable, match="closed"):
            store.append([b"y"])
        with pytest.raises(StoreUnavailable, match="closed"):
            store.append_at(1, [b"y"])
        with pytest.raises(StoreUnavailable, match="closed"):
            store.write_snapshot(1, b"s")
        with pytest.raises(StoreUnavailable, match="closed"):
            store.load()
        with pytest.raises(StoreUnavailable, match="closed"):
            store.read_since(0)
        with pytest.raises(StoreUnavailable, match="closed"):
            store.last_seq()

    def test_matches_a_model(self) -> None:
        """Any mix of appends (at the end, stale, past the end), snapshots, reads and reopens goes as a plain list model says."""
        ops = st.lists(
            st.one_of(
                st.tuples(st.just("append"), st.integers(1, 4)),
                st.tuples(st.just("append_at"), st.integers(1, 4)),
                st.tuples(st.just("stale"), st.integers(1, 4)),
                st.tuples(st.just("gap"), st.integers(1, 4)),
                st.tuples(st.just("snapshot"), st.integers(0, 5)),
                st.tuples(st.just("old snapshot"), st.integers(1, 3)),
                st.tuples(st.just("read_since"), st.integers(0, 8)),
                st.tuples(st.just("reopen"), st.just(0)),
            ),
            max_size=25,
        )

        # Defined per call so that each backend's class runs its own hypothesis test.
        @settings(max_examples=examples(25), deadline=None)
        @given(ops=ops)
        def check(ops: list[tuple[str, int]]) -> None:
            with tempfile.TemporaryDirectory() as tmp:
                store = self.open(Path(tmp))
                margin = self.margin(store)
                records: list[tuple[int, bytes]] = []  # every record ever acknowledged
                snapshot: tuple[int, bytes] | None = None
                try:
                    for n, (op, arg) in enumerate(ops):
                        last = records[-1][0] if records else 0
                        snap_seq = snapshot[0] if snapshot else 0
                        held = [r for r in records if r[0] > snap_seq - margin] if snapshot else records
                        if op in ("append", "append_at"):
                            batch = [_payload(n * 10 + i) for i in range(arg)]
                            got = store.append(batch) if op == "append" else store.append_at(last, batch)
                            assert got == last + arg
                            records += [(last + 1 + i, p) for i, p in enumerate(batch)]
                        elif op == "stale" and last > 0:
                            with pytest.raises(StoreConflict):
                                store.append_at(max(0, last - arg), [b"stale"])
                        elif op == "gap":
                            with pytest.raises(ValueError, match="gap"):
                                store.append_at(last + arg, [b"gap"])
                        elif op == "snapshot":
                            seq = max(snap_seq, last - arg)
                            store.write_snapshot(seq, b"snap%d" % n)
                            if snapshot is None or seq > snap_seq or not store.shared:
                                snapshot = (seq, b"snap%d" % n)
                        elif op == "old snapshot" and snap_seq > 0:
                            seq = max(0, snap_seq - arg)
                            if store.shared:
                                store.write_snapshot(seq, b"old")  # ignored
                            else:
                                with pytest.raises(ValueError, match="current snapshot"):
                                    store.write_snapshot(seq, b"old")
                        elif op == "read_since":
                            x = max(0, last - arg)
                            if x >= snap_seq or any(s == x + 1 for s, _ in held):
                                want = Recovered(None, x, [r for r in records if r[0] > x])
                            else:
                                want = Recovered(snapshot[1] if snapshot else None, snap_seq, [r for r in records if r[0] > snap_seq])
                            assert store.read_since(x) == want
                        elif op == "reopen":
                            store = self.reopen(store)
                        snap_seq = snapshot[0] if snapshot else 0
                        want = Recovered(snapshot[1] if snapshot else None, snap_seq, [r for r in records if r[0] > snap_seq])
                        assert store.load() == want
                        assert store.last_seq() == (records[-1][0] if records else 0)
                finally:
                    store.close()

        check()
