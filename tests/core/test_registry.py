"""The registry is the one place that knows the ways of dealing: a kind registered from a test, and an ast
guard that fails on any branch on a way of dealing outside the registry, the plan modules, the spec and the wire
(a comparison, a truth test or a read of what tells the kinds apart, a kind predicate, a plan class asked for)."""

from __future__ import annotations

import ast
import pathlib

import pytest
from _reverse_kind import REVERSE, reverse_registered

from croupier.core.registry import KINDS, kind_for, kind_named
from croupier.core.spec import Spec

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = ("core", "server", "client", "tools", "integrations")

#: Where a way of dealing may be named: the registry, each kind's plan module (and the fixed plan's
#: order engine, the deal book and the plan interface), the spec that validates its settings, the wire
#: that carries them.
WAYS_OF_DEALING = {"core/registry.py", "core/plan.py", "core/deals.py", "core/order.py", "core/tokens.py",
                   "core/dynamic.py", "core/shard_deals.py", "core/spec.py", "core/wire.py"}
#: The settings and plan attributes that tell the ways of dealing apart.
KIND_ATTRIBUTES = {"dealing", "max_tokens", "coordinator_deals", "fixed_batches", "dealer"}
#: The plan and kind attributes that say which way a plan is dealt: read (tested, or passed on to be tested
#: elsewhere) only where a way of dealing may be named; everyone else asks a method of the plan or its kind.
KIND_FLAGS = {"coordinator_deals", "dealer", "fixed_batches"}
#: Functions that ask whether a spec is of a particular kind.
KIND_PREDICATES = {"is_fixed", "fixed_plan_epoch"}
#: The registry's entries and the kinds' names, which only the registry compares against.
KIND_NAMES = {"FIXED", "TOKENS", "DYNAMIC"}
KIND_STRINGS = {"static", "dynamic", "fixed", "tokens"}
#: The plan modules of particular kinds.
PLAN_MODULES = {"croupier.core.dynamic", "croupier.core.shard_deals", "croupier.core.tokens"}
#: What a probe of a plan would ask for.
PLAN_MEMBERS = {"known_steps", "steps", "advance", "lease", "lease_positions", "grant", "nb_r", "share", "dealer",
                "coordinator_deals", "fixed_batches", "global_plan", "batches", "deal", "checkpoint", "samples",
                "known_samples", "agrees", "ends"}


def _names(node: ast.expr) -> list[str]:
    """The class names an isinstance's second argument names (a name, a dotted name, or a tuple of them)."""
    if isinstance(node, ast.Tuple):
        return [n for e in node.elts for n in _names(e)]
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    return []


def _tested(tree: ast.AST) -> tuple[set[int], set[int]]:
    """The ids of the expressions a truth test reads (the tests of ``if``, ``while``, ``assert``, a ternary and
    a comprehension's filter; the operands of ``and``, ``or`` and ``not``), and of the operands of comparisons."""
    tested: set[int] = set()
    compared: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            tested.add(id(node.test))
        elif isinstance(node, ast.comprehension):
            tested.update(id(e) for e in node.ifs)
        elif isinstance(node, ast.BoolOp):
            tested.update(id(v) for v in node.values)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            tested.add(id(node.operand))
        elif isinstance(node, ast.Compare):
            compared.update(id(s) for s in (node.left, *node.comparators))
    return tested, compared


def _called(node: ast.Call) -> str | None:
    """The name a call calls (``f(...)`` or ``m.f(...)``)."""
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _problems(rel: str, tree: ast.AST) -> list[str]:
    bad: list[str] = []
    tested, compared = _tested(tree)
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', 0)}"
        how = "truth-tests" if id(node) in tested else "reads"
        if (isinstance(node, ast.Attribute) and node.attr in KIND_FLAGS and isinstance(node.ctx, ast.Load)
                and id(node) not in compared):
            bad.append(f"{where}: {how} .{node.attr}")
        elif isinstance(node, (ast.arg, ast.keyword)) and node.arg in KIND_FLAGS:
            bad.append(f"{where}: passes on {node.arg}")
        elif isinstance(node, ast.Call) and _called(node) in KIND_PREDICATES:
            bad.append(f"{where}: calls the kind predicate {_called(node)}")
        elif isinstance(node, ast.MatchClass):
            bad += [f"{where}: matches {name}" for name in _names(node.cls) if name.endswith("Plan")]
        if isinstance(node, ast.Compare):
            sides = (node.left, *node.comparators)
            if any(isinstance(s, ast.Call) and _called(s) == "type" for s in sides):
                bad += [f"{where}: compares the type of a plan with {name}" for s in sides for name in _names(s)
                        if name.endswith("Plan")]
            if (any(isinstance(s, ast.Attribute) and s.attr == "name" for s in sides)
                    and any(isinstance(s, ast.Constant) and s.value in KIND_STRINGS for s in sides)):
                bad.append(f"{where}: compares a kind's name")
            for side in sides:
                if isinstance(side, ast.Attribute) and side.attr in KIND_ATTRIBUTES:
                    bad.append(f"{where}: compares .{side.attr}")
                elif isinstance(side, (ast.Name, ast.Attribute)) and (
                        getattr(side, "id", None) in KIND_NAMES or getattr(side, "attr", None) in KIND_NAMES):
                    bad.append(f"{where}: compares a registry entry")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("isinstance", "issubclass") and len(node.args) == 2:
                for name in _names(node.args[1]):
                    if name.endswith("Plan"):
                        bad.append(f"{where}: {node.func.id}(..., {name})")
            if (node.func.id in ("hasattr", "getattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in PLAN_MEMBERS):
                bad.append(f"{where}: probes a plan with {node.func.id}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in PLAN_MODULES:
                bad.append(f"{where}: imports from {node.module}")
            elif node.module == "croupier.core":
                bad += [f"{where}: imports croupier.core.{a.name}" for a in node.names
                        if f"croupier.core.{a.name}" in PLAN_MODULES]
        elif isinstance(node, ast.Import):
            bad += [f"{where}: imports {a.name}" for a in node.names if a.name in PLAN_MODULES]
    return bad


def dealing_branches(root: pathlib.Path = ROOT) -> list[str]:
    """Every place outside :data:`WAYS_OF_DEALING` that branches on a way of dealing: compares a setting or
    plan attribute that tells them apart, a registry entry or a kind's name; truth-tests or reads a plan's
    or kind's :data:`KIND_FLAGS` (in an ``if``, ``while``, ``assert``, ternary, comprehension filter,
    ``and``/``or``/``not``, or passed on, also as a parameter or keyword of that name); calls a kind predicate (:data:`KIND_PREDICATES`); asks
    isinstance of a plan class, matches one or compares a plan's type with one; imports a particular
    kind's plan module (hence calls into it); or probes a plan with hasattr/getattr."""
    bad = []
    for folder in SOURCES:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel not in WAYS_OF_DEALING:
                bad += _problems(rel, ast.parse(path.read_text(), rel))
    return bad


def test_no_branch_on_a_way_of_dealing_outside_the_registry() -> None:
    assert dealing_branches() == []


PLANTED = {
    "client/a.py": "def f(spec, p):\n    if spec.dealing == 'dynamic':\n        return getattr(p, 'known_steps', None)\n",
    "server/b.py": "from croupier.core.order import FixedPlan\n\ndef g(p):\n    return isinstance(p, (int, FixedPlan))\n",
    "server/c.py": "from croupier.core import dynamic\nfrom croupier.core.tokens import TokenPlan\nimport croupier.core.dynamic\n",
    "tools/d.py": "from croupier.core.registry import DYNAMIC, kind_of\n\ndef h(spec, p):\n"
                  "    return kind_of(spec) is DYNAMIC or p.coordinator_deals is True or p.fixed_batches != False\n",
    "integrations/e.py": "def k(kind):\n    return kind.name == 'tokens'\n",
    # truth tests, reads passed on, kind predicates and plan classes asked for otherwise than by isinstance
    "client/f.py": (
        "def f(plan, kind, spec, c):\n"
        "    if plan.coordinator_deals:\n"
        "        pass\n"
        "    x = not plan.dealer\n"
        "    y = plan.dealer is None or c\n"
        "    z = c and plan.fixed_batches\n"
        "    w = 1 if kind.coordinator_deals else 2\n"
        "    while plan.dealer:\n"
        "        break\n"
        "    assert kind.fixed_batches\n"
        "    g(deals=kind.coordinator_deals)\n"
        "    v = [q for q in c if q.dealer]\n"
        "    u = fixed_plan_epoch(spec, c, 1, 0) if is_fixed(spec) else registry.is_fixed(spec)\n"
        "    t = type(plan) is FixedPlan\n"
        "    match plan:\n"
        "        case DealtPlan():\n"
        "            pass\n"
    ),
    # the flag passed on under its own name, to be tested elsewhere
    "client/h.py": "class C:\n    def __init__(self, *, coordinator_deals: bool) -> None:\n        self.d = coordinator_deals\n\n"
                   "C(coordinator_deals=True)\n",
    # what every caller does instead: ask the plan or its kind (nothing to report)
    "tools/g.py": "def h(plan, kind):\n    return kind.either(plan.own_grant(0, 0, 1), kind.dealer_of(plan, 'j'))\n",
    "core/registry.py": "def allowed(spec):\n    return spec.dealing == 'static'\n",
}


def test_the_guard_fails_on_each_planted_branch(tmp_path: pathlib.Path) -> None:
    for folder in SOURCES:
        (tmp_path / folder).mkdir()
    for rel, text in PLANTED.items():
        (tmp_path / rel).write_text(text)
    assert dealing_branches(tmp_path) == [
        "server/b.py:4: isinstance(..., FixedPlan)",
        "server/c.py:1: imports croupier.core.dynamic", "server/c.py:2: imports from croupier.core.tokens",
        "server/c.py:3: imports croupier.core.dynamic",
        "client/a.py:2: compares .dealing", "client/a.py:3: probes a plan with getattr",
        "client/f.py:2: truth-tests .coordinator_deals", "client/f.py:8: truth-tests .dealer",
        "client/f.py:10: truth-tests .fixed_batches", "client/f.py:14: compares the type of a plan with FixedPlan",
        "client/f.py:4: truth-tests .dealer", "client/f.py:5: compares .dealer",
        "client/f.py:6: truth-tests .fixed_batches", "client/f.py:7: truth-tests .coordinator_deals",
        "client/f.py:13: calls the kind predicate is_fixed", "client/f.py:13: calls the kind predicate fixed_plan_epoch",
        "client/f.py:13: calls the kind predicate is_fixed", "client/f.py:16: matches DealtPlan",
        "client/f.py:11: reads .coordinator_deals", "client/f.py:12: truth-tests .dealer",
        "client/h.py:5: passes on coordinator_deals", "client/h.py:2: passes on coordinator_deals",
        "tools/d.py:4: compares a registry entry", "tools/d.py:4: compares .coordinator_deals",
        "tools/d.py:4: compares .fixed_batches",
        "integrations/e.py:2: compares a kind's name",
    ]


# ------------------------------------------------------------------ registering a kind


def test_a_kind_registered_from_a_test_is_known_while_registered_only() -> None:
    with pytest.raises(ValueError, match="dealing must be one of"):
        Spec(n=10, tail="uneven", dealing="reverse")
    with reverse_registered():
        spec = Spec(n=10, tail="uneven", dealing="reverse")
        assert kind_for("reverse") is REVERSE is kind_named("reverse") is KINDS["reverse"]
        with pytest.raises(ValueError, match="'reverse' is registered already"):
            with reverse_registered():
                pass
    assert "reverse" not in KINDS
    with pytest.raises(ValueError, match="dealing must be one of"):
        Spec(n=10, tail="uneven", dealing="reverse")
    with pytest.raises(ValueError, match="dealing must be one of"):
        kind_for(spec.dealing)


def test_a_name_taken_is_refused() -> None:
    from croupier.core.registry import PlanKind, registered

    for name in ("static", "dynamic"):
        with pytest.raises(ValueError, match="registered already"):
            with registered(PlanKind(name, REVERSE.make, True, True, 1, 1)):
                pass
    assert sorted(KINDS) == ["dynamic", "fixed", "shards", "shards-dynamic", "tokens"]
