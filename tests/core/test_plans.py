"""The plan interface: every registered way of dealing keeps the EpochPlan contract, one registry picks
the plan, and nothing outside the registry branches on the way of dealing."""

from __future__ import annotations

import ast
import pathlib
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from croupier.core import dynamic
from croupier.core.cursor import Cursor, fresh
from croupier.core.errors import OutOfRange
from croupier.core.plan import EpochPlan
from croupier.core.plans import KINDS, PlanKind, kind_for, kind_of, plan_epoch
from croupier.core.spec import Spec

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = ("core", "server", "client", "tools", "integrations")


def _spec(kind: str, n: int, batch: int, seed: int) -> Spec:
    lengths = (np.arange(n) * 7919 + seed) % 50 + 1
    if kind == "fixed":
        return Spec(n=n, seed=seed, batch_size=batch, tail="uneven")
    if kind == "tokens":
        return Spec.with_lengths(lengths, seed=seed, max_tokens=120, tail="uneven", token_window=64)
    return Spec(n=n, seed=seed, batch_size=batch, tail="uneven", dealing="dynamic")


def _lease_all(p: EpochPlan, rank: int, count: int, deal: dynamic.EpochDeals | None) -> list[int]:
    """Every index of `rank` in plan `p`, leased `count` steps at a time until the plan says it ends."""
    out: list[int] = []
    first = 0
    while True:
        grant = None
        if p.coordinator_deals:
            assert deal is not None
            runs, _ = dynamic.deal(deal, p.global_plan, rank, first, count)  # type: ignore[attr-defined]
            for g, c in runs:
                dynamic.apply_deal(deal, rank, g, c)
            end = not runs or runs[-1][0] + runs[-1][1] >= dynamic.total(p.global_plan)  # type: ignore[attr-defined]
            grant = p.grant(rank, first, count, (tuple(runs), end))
        else:
            grant = p.grant(rank, first, count)
        idx, sizes = p.lease(rank, first, count, grant)
        assert sum(sizes) == len(idx)
        assert p.agrees(grant, sizes)
        if p.fixed_batches:
            assert all(s == p.spec.batch_size for s in sizes[:-1])
        out += idx.tolist()
        if p.ends(rank, first, count, len(sizes), grant):
            return out
        first += len(sizes)
        assert sizes, "a lease that is not the end deals something"


def test_every_kind_is_registered_once_and_picked_by_its_spec() -> None:
    assert set(KINDS) == {"fixed", "tokens", "dynamic"}
    for name in KINDS:
        spec = _spec(name, 100, 4, 1)
        assert kind_of(spec) is KINDS[name]
        p = plan_epoch(spec, fresh(spec, 0), 3, 0)
        assert p is not None
        assert p.coordinator_deals == KINDS[name].coordinator_deals
        assert p.fixed_batches == KINDS[name].fixed_batches
        assert (p.spec, p.cursor, p.world) == (spec, fresh(spec, 0), 3)
    assert kind_for("static") is KINDS["fixed"] and kind_for("static", 5) is KINDS["tokens"]
    assert kind_for("dynamic") is KINDS["dynamic"]
    assert all(pickle.loads(pickle.dumps(k)) is k for k in KINDS.values()), "a sampler's kind travels by name"


@pytest.mark.parametrize("name", sorted(KINDS))
def test_the_epoch_rule_is_the_same_for_every_kind(name: str) -> None:
    spec = _spec(name, 60, 4, 2)
    start = Cursor(epoch=3, remaining=((10, 60),))
    assert plan_epoch(spec, start, 2, 3).cursor == start  # type: ignore[union-attr]
    assert plan_epoch(spec, start, 2, 4).cursor == fresh(spec, 4)  # type: ignore[union-attr]
    assert plan_epoch(spec, fresh(spec, 3), 2, 2) is None  # the epoch a fresh start finished
    with pytest.raises(OutOfRange, match="before this generation's resume point"):
        plan_epoch(spec, start, 2, 2)
    assert plan_epoch(spec, start, 2, 3) is plan_epoch(spec, start, 2, 3), "plans are cached"


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(KINDS)), n=st.integers(1, 300), batch=st.integers(1, 9), world=st.integers(1, 6),
       count=st.integers(1, 5), seed=st.integers(0, 2**20))
def test_a_plan_deals_every_remaining_position_once(name: str, n: int, batch: int, world: int, count: int,
                                                    seed: int) -> None:
    """With the uneven tail, the ranks' leases together are the epoch's remainder, each index once."""
    spec = _spec(name, n, batch, seed)
    p = plan_epoch(spec, fresh(spec, 0), world, 0)
    assert p is not None
    deal = dynamic.EpochDeals() if p.coordinator_deals else None
    # NOTE: a dynamic plan deals to whoever asks: the ranks ask in turn, one lease each.
    got = [i for r in range(world) for i in _lease_all(p, r, count, deal)]
    assert sorted(got) == list(range(spec.n))
    if p.known_steps(0) is not None:
        assert p.known_steps(0) == p.steps(0)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["fixed", "tokens"]), n=st.integers(1, 300), batch=st.integers(1, 9),
       world=st.integers(1, 6), new_world=st.integers(1, 6), steps=st.integers(0, 40), seed=st.integers(0, 2**20))
def test_advance_is_topology_free(name: str, n: int, batch: int, world: int, new_world: int, steps: int,
                                  seed: int) -> None:
    """What the ranks took before `advance` and what any new world is dealt after it: the epoch, each index once."""
    spec = _spec(name, n, batch, seed)
    p = plan_epoch(spec, fresh(spec, 0), world, 0)
    assert p is not None
    taken = [i for r in range(world) for i in p.lease(r, 0, steps)[0].tolist()]
    cursor = p.advance(steps)
    if cursor.epoch == 1:
        assert sorted(taken) == list(range(spec.n))
        return
    q = plan_epoch(spec, cursor, new_world, 0)
    assert q is not None
    rest = [i for r in range(new_world) for i in _lease_all(q, r, 3, None)]
    assert sorted(taken + rest) == list(range(spec.n))


def test_a_plan_the_coordinator_deals_needs_its_deal() -> None:
    spec = _spec("dynamic", 50, 4, 0)
    p = plan_epoch(spec, fresh(spec, 0), 2, 0)
    assert p is not None and p.coordinator_deals and p.known_steps(0) is None
    with pytest.raises(ValueError, match="dealt"):
        p.grant(0, 0, 1)
    with pytest.raises(ValueError, match="grant"):
        p.lease(0, 0, 1)
    with pytest.raises(ValueError, match="coordinator"):
        p.advance(1)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_sampler_defaults_come_from_the_registry(kind: str) -> None:
    k: PlanKind = KINDS[kind]
    assert k.tail(False, batches=True) == ("uneven" if k.coordinator_deals else "pad")
    assert k.tail(True, batches=False) == "drop"
    assert k.permutation(False, True) == "none"
    assert k.permutation(True, True) == ("bucket" if k.fixed_batches else "feistel")


# ------------------------------------------------------------------ the registry is the one place


#: Files allowed to read the settings that decide the way of dealing: the registry, the spec that
#: validates them, the wire that carries them, and the token plan that reads its own budget.
DEALING_READERS = {"core/plans.py", "core/spec.py", "core/wire.py", "core/tokens.py"}


def dealing_branches(root: pathlib.Path = ROOT) -> list[str]:
    """Every place outside the registry that reads ``.dealing`` or ``.max_tokens`` of a spec in a
    comparison, or probes an object with hasattr/getattr for a plan's method."""
    bad = []
    for folder in SOURCES:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text(), rel)
            for node in ast.walk(tree):
                if isinstance(node, ast.Compare) and rel not in DEALING_READERS:
                    for side in (node.left, *node.comparators):
                        if isinstance(side, ast.Attribute) and side.attr in ("dealing", "max_tokens"):
                            bad.append(f"{rel}:{node.lineno}: compares .{side.attr}")
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id in ("hasattr", "getattr") and len(node.args) >= 2
                        and isinstance(node.args[1], ast.Constant)
                        and node.args[1].value in ("known_steps", "steps", "advance", "lease", "grant", "nb_r")):
                    bad.append(f"{rel}:{node.lineno}: probes a plan with {node.func.id}")
    return bad


def test_no_dealing_branches_outside_the_registry() -> None:
    assert dealing_branches() == []


def test_the_branch_check_can_fail(tmp_path: pathlib.Path) -> None:
    for folder in SOURCES:
        (tmp_path / folder).mkdir()
    (tmp_path / "client" / "x.py").write_text(
        "def f(spec, p):\n    if spec.dealing == 'dynamic':\n        return getattr(p, 'known_steps', None)\n")
    assert dealing_branches(tmp_path) == ["client/x.py:2: compares .dealing", "client/x.py:3: probes a plan with getattr"]


# ------------------------------------------------------------------ no import cycles


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """croupier module -> the croupier modules it imports (at any level of the file)."""
    packages = {"core": "croupier.core", "server": "croupier.server", "client": "croupier.client",
                "tools": "croupier.tools", "integrations": "croupier.integrations"}
    graph: dict[str, set[str]] = {}
    for folder, pkg in packages.items():
        for path in sorted((root / folder).rglob("*.py")):
            name = pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"
            deps = graph.setdefault(name, set())
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("croupier"):
                    deps.add(node.module)
                    deps.update(f"{node.module}.{a.name}" for a in node.names)
                elif isinstance(node, ast.Import):
                    deps.update(a.name for a in node.names if a.name.startswith("croupier"))
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def cycles(graph: dict[str, set[str]], within: tuple[str, ...]) -> list[list[str]]:
    """The import cycles among the modules whose names start with one of `within` (package
    ``__init__`` modules excluded: a package re-exporting its modules is no cycle)."""
    nodes = {m for m in graph if m.startswith(within) and m.count(".") >= 2}
    found: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m] & nodes):
            if state.get(d) == 1:
                found.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(nodes):
        if m not in state:
            visit(m, [m])
    return found


def test_no_import_cycles() -> None:
    g = import_graph()
    assert cycles(g, ("croupier.core.",)) == []
    assert cycles(g, ("croupier.server._store", "croupier.server._sqlite_store", "croupier.server._pg_store",
                      "croupier.server._memory_store")) == []
    assert cycles(g, ("croupier.tools.",)) == []


def test_the_cycle_check_can_fail() -> None:
    g = {"croupier.core.a": {"croupier.core.b"}, "croupier.core.b": {"croupier.core.a"}}
    assert cycles(g, ("croupier.core.",)) == [["croupier.core.a", "croupier.core.b", "croupier.core.a"]]
