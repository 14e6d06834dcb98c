"""The registry is the one place that knows the ways of dealing: a kind registered from a test, and an ast
guard that fails on any branch on a way of dealing outside the registry, the plan modules, the spec and the wire."""

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
                   "core/dynamic.py", "core/spec.py", "core/wire.py"}
#: The settings and plan attributes that tell the ways of dealing apart.
KIND_ATTRIBUTES = {"dealing", "max_tokens", "coordinator_deals", "fixed_batches"}
#: The registry's entries and the kinds' names, which only the registry compares against.
KIND_NAMES = {"FIXED", "TOKENS", "DYNAMIC"}
KIND_STRINGS = {"static", "dynamic", "fixed", "tokens"}
#: The plan modules of particular kinds.
PLAN_MODULES = {"croupier.core.dynamic", "croupier.core.tokens"}
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


def _problems(rel: str, tree: ast.AST) -> list[str]:
    bad: list[str] = []
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Compare):
            sides = (node.left, *node.comparators)
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
    plan attribute that tells them apart, a registry entry or a kind's name; asks isinstance of a plan
    class; imports a particular kind's plan module (hence calls into it); or probes a plan with
    hasattr/getattr."""
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
    assert sorted(KINDS) == ["dynamic", "fixed", "tokens"]
