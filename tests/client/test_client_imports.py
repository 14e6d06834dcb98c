"""The client's modules import one another without a cycle (two modules that call into each other are one idea split badly)."""

from __future__ import annotations

import ast
import pathlib

CLIENT = pathlib.Path(__file__).resolve().parents[2] / "client"


def client_graph(folder: pathlib.Path = CLIENT) -> dict[str, set[str]]:
    """Each client module (``__init__`` aside: re-exporting is no cycle) -> the client modules it imports,
    at any level of the file (under ``TYPE_CHECKING`` too)."""
    names = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in sorted(names):
        deps: set[str] = set()
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "croupier.client":
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("croupier.client."):
                deps.add(node.module.rsplit(".", 1)[1])
            elif isinstance(node, ast.Import):
                deps.update(a.name.rsplit(".", 1)[1] for a in node.names if a.name.startswith("croupier.client."))
        graph[name] = (deps & names) - {name}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (found := visit(d, path + [d])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [m])):
            return found
    return None


def test_no_import_cycle_among_client_modules() -> None:
    graph = client_graph()
    assert {"_base", "_checkpointer", "_amender", "_epoch"} <= set(graph)
    assert cycle(graph) is None


def test_the_client_cycle_check_can_fail(tmp_path: pathlib.Path) -> None:
    (tmp_path / "_base.py").write_text("from croupier.client import _checkpointer\n")
    (tmp_path / "_checkpointer.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from croupier.client._base import _Base\n")
    (tmp_path / "_epoch.py").write_text("import croupier.client._sample\n")
    (tmp_path / "_sample.py").write_text("")
    graph = client_graph(tmp_path)
    assert graph["_epoch"] == {"_sample"}
    assert cycle(graph) == ["_base", "_checkpointer", "_base"]
