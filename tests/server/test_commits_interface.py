"""The coordinator and its commit protocols talk through the Commits interface: neither reads the other's private attributes."""

from __future__ import annotations

import ast
import inspect
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULES = ("server/_commits.py", "server/_shared_commits.py", "server/_coordinator.py")


def reaches_in(source: str, name: str) -> list[str]:
    """Every ``x._attr`` (or ``getattr(x, "_attr")``) in `source` where x is not ``self`` or ``cls``,
    and every import of the coordinator's module, as 'name:line: what'."""
    out: list[str] = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and str(node.args[1].value).startswith("_")):
            out.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and name.endswith("_commits.py") and (node.module or "").endswith("_coordinator"):
            out.append(f"{name}:{node.lineno}: imports {node.module}")
    return out


def test_neither_reads_the_others_private_attributes() -> None:
    found = [hit for m in MODULES for hit in reaches_in((ROOT / m).read_text(), m)]
    assert found == []


def test_the_check_can_fail() -> None:
    source = (
        "from croupier.server._coordinator import Coordinator\n"
        "def commit(self, c):\n"
        "    self._mine = c.state\n"  # its own, and a public name: allowed
        "    c._seq += 1\n"
        "    return self.c._cond, getattr(c, '_failed')\n"
    )
    assert reaches_in(source, "server/_commits.py") == [
        "server/_commits.py:1: imports croupier.server._coordinator",
        "server/_commits.py:4: c._seq",
        "server/_commits.py:5: self.c._cond",
        "server/_commits.py:5: getattr(c, '_failed')",
    ]


def lock_parameters(cls: type) -> list[str]:
    """The parameters of `cls`'s constructor that take a lock (a Condition, Lock or RLock)."""
    params = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in params if any(w in str(p.annotation) for w in ("Condition", "Lock"))]


def test_the_protocols_share_no_lock_with_the_coordinator() -> None:
    """Each protocol makes the lock that guards its state; the coordinator hands it none and makes none to share."""
    from croupier.server._commits import WriterCommits
    from croupier.server._shared_commits import SharedCommits

    assert [(c.__name__, lock_parameters(c)) for c in (WriterCommits, SharedCommits)] == [
        ("WriterCommits", []), ("SharedCommits", [])]
    coordinator = (ROOT / "server/_coordinator.py").read_text()
    assert "threading.Condition(" not in coordinator and "threading.RLock(" not in coordinator


def test_the_lock_check_can_fail() -> None:
    import threading

    class Given:
        def __init__(self, store: object, cond: threading.Condition) -> None: ...

    assert lock_parameters(Given) == ["cond"]
