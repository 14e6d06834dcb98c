"""The golden orders (tests/golden/orders.json): the engine yields, index for index, what the file holds."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from _sim import batches_of

from croupier.core import ORDER_VERSION, registry
from croupier.core import feistel as _feistel
from croupier.core import permute as _permute
from croupier.core import shards as _shards
from croupier.core.order import Cursor, order
from croupier.core.spec import PARTITIONS, PERMUTATIONS, SCOPES, TAILS, Spec

GOLDEN = json.loads((pathlib.Path(__file__).resolve().parents[1] / "golden" / "orders.json").read_text())
#: Samples up to this many positions are also checked one position per call (the scalar Feistel path).
PER_POSITION = 64

#: The engine's caches, held before any test patches the functions they belong to.
_CACHES: tuple[Callable[[], None], ...] = (
    _feistel.round_keys.cache_clear,
    _permute._window_key.cache_clear,
    _permute._bucket_window.cache_clear,
    _permute._torch_randperm.cache_clear,
    _shards._epoch_table.cache_clear,  # the shard order's tables and window keys
    _shards._window_keys.cache_clear,
    _shards._window_rounds.cache_clear,
    registry.cache_clear,
)


def _clear_caches() -> None:
    """Forgets every cached key, window and randperm, so none computed under a planted change survives it."""
    for clear in _CACHES:
        clear()


def _spec(kw: dict[str, Any]) -> Spec:
    """The spec a golden case describes (``lengths`` and ``shards`` as lists of ints)."""
    if kw.get("lengths") is not None:
        return Spec.with_lengths(kw["lengths"], **{k: v for k, v in kw.items() if k not in ("n", "lengths")})
    if kw.get("shards") is not None:
        return Spec.with_shards(kw["shards"], **{k: v for k, v in kw.items() if k not in ("n", "shards", "lengths")})
    return Spec(**{k: v for k, v in kw.items() if k != "lengths"})


def _diff(what: str, got: list[Any], want: list[Any]) -> list[str]:
    """[] when equal, else one line naming the first difference."""
    if got == want:
        return []
    if len(got) != len(want):
        return [f"{what}: {len(got)} items, the golden file has {len(want)}"]
    k = next(i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w)
    wrong = sum(g != w for g, w in zip(got, want, strict=True))
    return [f"{what}: {wrong} of {len(want)} items differ, the first at {k} (got {got[k]!r}, golden {want[k]!r})"]


def golden_mismatches(golden: dict[str, Any]) -> list[str]:
    """Every way the engine differs from the golden file, one line each; [] when it yields the same.

    Plans: the full order of positions [0, n) (one call: the vectorised Feistel path) and every
    rank's batches (one call per batch: the scalar path). Samples: the indices at fixed positions
    in one call, and, for the short ones, one position per call.
    """
    out: list[str] = []
    for case in golden["plans"]:
        spec, cid = _spec(case["spec"]), case["id"]
        cursor = Cursor(case["epoch"], tuple((a, b) for a, b in case["remaining"]), case["base_world"])
        out += _diff(f"{cid} order", order(spec, case["epoch"], np.arange(spec.n), case["base_world"]).tolist(),
                     case["order"])
        p = registry.plan_epoch(spec, cursor, case["world"], case["epoch"])
        assert p is not None
        for r, want in enumerate(case["ranks"]):
            out += _diff(f"{cid} rank {r}", batches_of(p, r), want)
    for case in golden["samples"]:
        spec, cid = _spec(case["spec"]), case["id"]
        pos = np.array(case["positions"], dtype=np.int64)
        out += _diff(f"{cid} at once", order(spec, case["epoch"], pos, case["base_world"]).tolist(), case["indices"])
        if len(pos) <= PER_POSITION:
            one = [int(order(spec, case["epoch"], pos[k : k + 1], case["base_world"])[0]) for k in range(len(pos))]
            out += _diff(f"{cid} one by one", one, case["indices"])
    return out


def _ids(mismatches: list[str]) -> set[str]:
    """The golden cases a list of mismatches names."""
    return {m.split(" ", 1)[0] for m in mismatches}


def test_the_engine_yields_the_golden_orders() -> None:
    assert GOLDEN["order_version"] == ORDER_VERSION, (
        "ORDER_VERSION changed but the golden file did not: regenerate it with tests/golden/make_golden.py"
    )
    assert golden_mismatches(GOLDEN) == []


def test_the_golden_file_covers_every_order() -> None:
    """Every permutation x partition x tail, globally and split per rank where valid; Feistel near 2**32 and 2**40."""
    want = set()
    for permutation in PERMUTATIONS:
        for partition in PARTITIONS:
            for tail in TAILS:
                for scope in SCOPES:
                    kw: dict[str, Any] = dict(permutation=permutation, partition=partition, tail=tail, scope=scope)
                    if permutation == "bucket":
                        kw.update(buffer_size=5, pack_size=2, lengths=b"\0" * 8 * 23)
                    if permutation == "shards":
                        kw.update(shards=np.full(23, 1, dtype="<i8").tobytes())
                    try:
                        Spec(n=23, **kw)
                    except ValueError:
                        continue
                    want |= {f"{permutation}/{partition}/{tail}/{scope}/{c}" for c in ("fresh", "resumed")}
    assert {c["id"] for c in GOLDEN["plans"]} == want
    # every permutation with every partition, but a shard order (its reader groups are its partition);
    # three split per rank as well
    assert len(want) == 2 * ((len(PERMUTATIONS) - 1) * len(PARTITIONS) * len(TAILS) + len(TAILS) + 3 * 2 * len(TAILS))
    large = {c["spec"]["n"] for c in GOLDEN["samples"] if c["spec"].get("permutation") == "feistel"}
    assert {2**32 - 1, 2**32, 2**32 + 1, 2**40 - 1, 2**40, 2**40 + 1} <= large
    sharded = {c["spec"]["n"] for c in GOLDEN["samples"] if c["spec"].get("shards")}
    assert {2**32 - 1, 2**32, 2**32 + 1, 2**40 - 1, 2**40, 2**40 + 1} <= sharded
    for case in GOLDEN["samples"]:
        n, pos = case["spec"]["n"], case["positions"]
        assert pos[:8] == list(range(8)) and pos[-8:] == list(range(n - 8, n)) and len(pos) > 16, case["id"]


def _flip_round_key(mp: pytest.MonkeyPatch) -> None:
    real = _feistel.round_keys

    def flipped(key: int) -> np.ndarray:
        keys: np.ndarray = np.array(real(key), dtype=np.uint64)  # a writable copy
        keys[-1] ^= np.uint64(1)  # one bit of the last round's key
        return keys

    mp.setattr(_feistel, "round_keys", flipped)


#: One-bit changes to the order engine, and the golden cases each one must break.
PLANTED: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], Callable[[str], bool]]] = {
    # The vectorised rounds' mixing constant: every order that shuffles more than 16 positions at once.
    "bit 17 of _M1 (vectorised rounds)": (
        lambda mp: mp.setattr(_feistel, "_M1", np.uint64(int(_feistel._M1) ^ (1 << 17))),
        lambda cid: cid.startswith("feistel/") and "/rank/" not in cid,
    ),
    # The same constant in the scalar rounds: every Feistel-keyed order of a few positions.
    "bit 17 of _M1_INT (scalar rounds)": (
        lambda mp: mp.setattr(_feistel, "_M1_INT", _feistel._M1_INT ^ (1 << 17)),
        lambda cid: cid.split("/")[0] in ("feistel", "window"),
    ),
    "bit 0 of the last round key": (
        _flip_round_key,
        lambda cid: cid.split("/")[0] in ("feistel", "window", "bucket"),
    ),
    # The bucket pack shuffle's key tag: the packs land in another order; nothing else moves.
    "bit 0 of the bucket pack key tag": (
        lambda mp: mp.setattr(_permute, "_BUCKET_TAG", _permute._BUCKET_TAG ^ 1),
        lambda cid: cid.startswith("bucket/"),
    ),
}


@pytest.mark.parametrize("name", list(PLANTED))
def test_a_one_bit_change_breaks_the_golden_orders(name: str) -> None:
    """The comparison can fail: each planted change is reported, in every case it must reach."""
    plant, reaches = PLANTED[name]
    _clear_caches()  # nothing computed before the change may hide it
    try:
        with pytest.MonkeyPatch.context() as mp:
            plant(mp)
            found = golden_mismatches(GOLDEN)
    finally:
        _clear_caches()  # nor leak it to the tests that follow
    cases = [c["id"] for c in GOLDEN["plans"] + GOLDEN["samples"]]
    must = {cid for cid in cases if reaches(cid)}
    assert must, name
    assert must <= _ids(found), f"{name}: not reported for {sorted(must - _ids(found))}"
    if name.endswith("bucket pack key tag"):
        assert _ids(found) == must, f"{name}: reported outside bucket orders {sorted(_ids(found) - must)}"
    assert golden_mismatches(GOLDEN) == []  # the change is gone with the patch and the caches


# --------------------------------------------------------------------------- mixtures

MIXTURES = json.loads((pathlib.Path(__file__).resolve().parents[1] / "golden" / "mixtures.json").read_text())


def mixture_mismatches(golden: dict[str, Any]) -> list[str]:
    """Every way the mixtures' orders and seeds differ from tests/golden/mixtures.json, one line each."""
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "golden"))
    from make_golden import mixture_spec

    from croupier.core.mixture import sample_seeds

    out = []
    for k, m in enumerate(golden["mixtures"]):
        spec = mixture_spec(m["case"])
        for p in m["points"]:
            pos = np.arange(p["first"], p["first"] + len(p["index"]), dtype=np.int64)
            idx, src, sep = _permute.mixture_order(spec, p["epoch"], pos)
            seeds = sample_seeds(spec.seed, src, sep, idx)
            for what, got in (("index", idx), ("source", src), ("source_epoch", sep), ("seed", seeds)):
                out += _diff(f"mixture {k} epoch {p['epoch']} {what}", got.tolist(), p[what])
    return out


def test_mixtures_yield_the_golden_orders_and_seeds() -> None:
    assert MIXTURES["order_version"] == ORDER_VERSION
    assert mixture_mismatches(MIXTURES) == []


def test_a_changed_mixture_key_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from croupier.core import mixture, stream

    monkeypatch.setattr(mixture, "SOURCE_TAG", mixture.SOURCE_TAG + 1)  # one source permutation key derivation
    stream.stream.cache_clear()
    try:
        assert any("index" in line for line in mixture_mismatches(MIXTURES))
    finally:
        stream.stream.cache_clear()
