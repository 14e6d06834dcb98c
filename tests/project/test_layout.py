"""The import contract: a pure core both sides depend on, a server that never imports the client,
and no package reaching into another's private modules."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: Source folder -> the package it installs as.
PACKAGES = {"core": "croupier.core", "server": "croupier.server", "client": "croupier.client", "tools": "croupier.tools",
            "harness": "croupier.harness", "demos": "croupier.demos", "integrations": "croupier.integrations",
            "data": "croupier.data"}
#: What each package may import of croupier (its own package always).
ALLOWED = {
    "croupier.core": {"croupier.v1"},
    "croupier.server": {"croupier.core", "croupier.v1"},
    "croupier.client": {"croupier.core", "croupier.v1", "croupier.server"},  # the server: the embedded coordinator
    # The product's commands; the CLI starts the demos and the chaos run (CLI_ONLY).
    "croupier.tools": {"croupier.core", "croupier.v1", "croupier.server", "croupier.client", "croupier.data",
                       "croupier.harness", "croupier.demos"},
    # The demos: a job on this machine's processes, audited by the product's commands.
    "croupier.demos": {"croupier.core", "croupier.v1", "croupier.server", "croupier.client", "croupier.data",
                       "croupier.tools"},
    # Fault injection and the checkers: the demos' job and trainer under faults, checked with the commands' audit.
    "croupier.harness": {"croupier.core", "croupier.v1", "croupier.server", "croupier.client", "croupier.data",
                         "croupier.tools", "croupier.demos"},
    # The trainers' glue: the client's public API only, as a user's code would use it.
    "croupier.integrations": {"croupier.core", "croupier.client"},
    # Sharded datasets: the core's checks, and the client's FILTERED for a skipped shard's samples.
    "croupier.data": {"croupier.core", "croupier.client"},
}
#: Third-party modules a package must not import at module level (lazily inside a function is allowed).
NOT_AT_TOP = {"croupier.core": {"grpc", "sqlite3", "torch", "msgpack"}}
#: Packages the product's commands reach only from the command line, lazily (``croupier chaos``, ``croupier demo``):
#: no other command module imports them, and the CLI not at module level.
CLI_ONLY = {"croupier.harness", "croupier.demos"}
CLI = "tools/cli.py"


def _imports(path: pathlib.Path) -> list[tuple[str, int, bool]]:
    """(module, line, at module level) for every import in a file."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, node.lineno, id(node) in top))
            out += [(f"{node.module}.{a.name}", node.lineno, id(node) in top) for a in node.names]
    return out


def violations(root: pathlib.Path = ROOT) -> list[str]:
    """Every import that breaks the contract, as 'file:line: reason'."""
    bad: dict[str, str] = {}  # one reason per import statement
    for folder, pkg in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            where = path.relative_to(root)
            for mod, line, at_top in _imports(path):
                parts = mod.split(".")
                if parts[0] in NOT_AT_TOP.get(pkg, set()) and at_top:
                    bad.setdefault(f"{where}:{line}", f"{pkg} imports {parts[0]} at module level")
                if parts[0] != "croupier" or len(parts) < 2:
                    continue
                other = ".".join(parts[:2])
                if other == pkg:
                    continue
                if other not in ALLOWED[pkg]:
                    bad.setdefault(f"{where}:{line}", f"{pkg} must not import {other} ({mod})")
                elif pkg == "croupier.tools" and other in CLI_ONLY and (where.as_posix() != CLI or at_top):
                    bad.setdefault(f"{where}:{line}", f"only {CLI} imports {other}, inside the command's function ({mod})")
                elif any(p.startswith("_") for p in parts[2:]):
                    bad.setdefault(f"{where}:{line}", f"{pkg} imports a private module of {other} ({mod})")
    return [f"{k}: {v}" for k, v in bad.items()]


def test_import_contract() -> None:
    assert violations() == []


def test_import_contract_catches_a_breach(tmp_path: pathlib.Path) -> None:
    """The check can fail: a server module that imports the client, a client reaching into the server."""
    for folder in PACKAGES:
        (tmp_path / folder).mkdir()
    (tmp_path / "server" / "bad.py").write_text("def f():\n    from croupier.client import DistributedSampler\n")
    (tmp_path / "client" / "bad.py").write_text("from croupier.server._state import State\n")
    (tmp_path / "core" / "bad.py").write_text("import grpc\n")
    (tmp_path / "tools" / "status.py").write_text("def f():\n    from croupier.harness import chaos\n")
    (tmp_path / "tools" / "cli.py").write_text("from croupier.demos import demo\n")
    (tmp_path / "demos" / "bad.py").write_text("from croupier.harness import chaos\n")
    found = violations(tmp_path)
    assert len(found) == 6, found


def private_reads(root: pathlib.Path = ROOT) -> list[str]:
    """Every read in tools/, harness/ or demos/ of another object's private attribute (``x._name``,
    ``getattr(x, "_name")``), as 'file:line: name': the commands, the harness and the demos read the
    server's and the client's objects through their public names (a stored state through
    ``croupier.server.generation_deals``, a sampler through its properties), so their internals stay
    free to change."""
    out: list[str] = []
    for path in sorted(p for room in ("tools", "harness", "demos") if (root / room).is_dir()
                       for p in (root / room).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = None
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    name = node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and str(node.args[1].value).startswith("_")
                  and not str(node.args[1].value).startswith("__")):
                name = str(node.args[1].value)
            if name is not None:
                out.append(f"{path.relative_to(root)}:{node.lineno}: {name}")
    return out


def test_the_commands_harness_and_demos_read_no_private_attribute() -> None:
    assert private_reads() == []


def test_the_private_read_check_can_fail(tmp_path: pathlib.Path) -> None:
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "bad.py").write_text(
        "def f(state, sampler, self):\n"
        "    self._mine = 1\n"  # its own: allowed
        "    return state._jobs, getattr(sampler, '_token', None), hasattr(sampler, '__len__')\n")
    assert private_reads(tmp_path) == ["tools/bad.py:3: _jobs", "tools/bad.py:3: _token"]


@pytest.mark.parametrize(
    ("module", "absent"),
    [
        ("croupier.core", ["grpc", "sqlite3", "torch", "croupier.server", "croupier.client"]),
        ("croupier.core.wire", ["grpc", "sqlite3"]),
        ("croupier.client", ["sqlite3", "croupier.server", "croupier.tools"]),
        ("croupier.server", ["croupier.client", "croupier.tools"]),
        ("croupier.data", ["torch", "croupier.server", "croupier.tools"]),
        ("croupier.tools.cli", ["croupier.harness", "croupier.demos", "torch"]),
    ],
)
def test_what_an_import_loads(module: str, absent: list[str]) -> None:
    code = f"import sys, {module}; print(','.join(m for m in {absent!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"import {module} loaded {out}"


# ---------------------------------------------------------------------- the tests' own layout

TEST_FOLDERS = {"core", "server", "client", "tools", "harness", "demos", "integrations", "data", "e2e", "deploy", "benchmarks",
                "project"}
LONGEST_TEST_FILE = 500


def layout_problems(root: pathlib.Path = ROOT) -> list[str]:
    """What breaks the tests' layout (docs/testing.md): a test file outside the folders, a name used
    twice (pytest imports test modules by their base name), a file over 500 lines."""
    out: list[str] = []
    seen: dict[str, pathlib.Path] = {}
    for f in sorted((root / "tests").rglob("*.py")):
        rel = f.relative_to(root / "tests")
        if rel.parts[0] in ("fixtures", "golden"):
            continue
        if f.name.startswith("test_") and (len(rel.parts) != 2 or rel.parts[0] not in TEST_FOLDERS):
            out.append(f"{rel}: a test file belongs in one of tests/{{{','.join(sorted(TEST_FOLDERS))}}}/")
        if f.name in seen and f.name != "__init__.py":
            out.append(f"{rel}: its name is also {seen[f.name].relative_to(root / 'tests')}'s")
        seen[f.name] = f
        if (n := len(f.read_text().splitlines())) > LONGEST_TEST_FILE:
            out.append(f"{rel}: {n} lines (at most {LONGEST_TEST_FILE})")
    return out


def test_the_tests_are_laid_out_like_the_code() -> None:
    assert layout_problems() == []


def test_the_tests_layout_check_can_fail(tmp_path: pathlib.Path) -> None:
    (tmp_path / "tests" / "core").mkdir(parents=True)
    (tmp_path / "tests" / "server").mkdir()
    (tmp_path / "tests" / "test_flat.py").write_text("")
    (tmp_path / "tests" / "core" / "test_same.py").write_text("")
    (tmp_path / "tests" / "server" / "test_same.py").write_text("x = 1\n" * 501)
    found = layout_problems(tmp_path)
    assert len(found) == 3, found


def doc_test_references(root: pathlib.Path = ROOT) -> list[str]:
    """Each `tests/...py` (and `::test_name`) a page of docs/ or the README names that does not exist."""
    out: list[str] = []
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    for page in pages:
        text = page.read_text()
        for m in re.finditer(r"tests/([\w/]+\.py)((?:::\w+)?)", text):
            f = root / "tests" / m.group(1)
            if not f.is_file():
                out.append(f"{page.relative_to(root)}: tests/{m.group(1)} does not exist")
            elif m.group(2) and not re.search(rf"^\s*(async )?def {m.group(2)[2:]}\b|^class {m.group(2)[2:]}\b",
                                              f.read_text(), re.M):
                out.append(f"{page.relative_to(root)}: tests/{m.group(1)} has no {m.group(2)[2:]}")
    return out


def test_the_docs_name_tests_that_exist() -> None:
    assert doc_test_references() == []


def test_the_docs_test_check_can_fail(tmp_path: pathlib.Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests" / "core").mkdir(parents=True)
    (tmp_path / "tests" / "core" / "test_a.py").write_text("def test_there() -> None:\n    pass\n")
    (tmp_path / "README.md").write_text("`tests/core/test_a.py::test_there` `tests/test_a.py`\n")
    (tmp_path / "docs" / "x.md").write_text("`tests/core/test_a.py::test_gone`\n")
    found = doc_test_references(tmp_path)
    assert len(found) == 2, found


# ------------------------------------------------------------------ no import cycles


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """croupier module -> the croupier modules it imports (at any level of the file)."""
    graph: dict[str, set[str]] = {}
    for folder, pkg in PACKAGES.items():
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


#: Import cycles tolerated: none (the commit strategies no longer call back into the coordinator).
KNOWN_CYCLES: list[list[str]] = []


def test_no_import_cycles() -> None:
    """No package's modules import one another in a circle (two modules that call into each other are
    one idea split badly)."""
    assert cycles(import_graph(), ("croupier.",)) == KNOWN_CYCLES


def test_the_cycle_check_can_fail() -> None:
    g = {"croupier.core.a": {"croupier.core.b"}, "croupier.core.b": {"croupier.core.a"}}
    assert cycles(g, ("croupier.core.",)) == [["croupier.core.a", "croupier.core.b", "croupier.core.a"]]
