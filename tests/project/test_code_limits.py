"""The limits a reader can hold: no file over 500 lines, no function over 80, no module reading
another's private names, and no value checked outside ``core/checks.py``.

What counts, precisely (over the packages' folders: core, server, client, tools, harness, demos,
integrations, data; the tests, benchmarks, examples and scripts are not held to these):

- **a file's length**: its lines, blank and comment lines included.
- **a function's length**: from its ``def`` line to its last line (its decorators not counted; a
  nested function counts in its enclosing one's length and on its own).
- **a private name**: a name with one leading underscore (``_x``, not ``__x__``) bound at the top of
  a croupier module: a function, class, constant or import there. Reading one across modules is
  ``from croupier.m import _x`` (or ``from . import _x`` resolved) in another module, or ``m._x``
  where ``m`` names another croupier module imported into the file. A private *module*
  (``from croupier.server import _state``) is not a private name: whether a package may import
  another's private modules is the import contract's question (tests/project/test_layout.py).
  Attributes of objects (``job._x``) are not module names and are not counted here.
- **a value check**: an ``if`` whose body raises ``ValueError`` or ``TypeError`` with a message
  saying what a value "must be", and whose test (through ``not``, ``and``, ``or``) asks what
  ``core/checks.py`` answers: a type test of a plain value (``isinstance(v, int)``, of ``int``,
  ``float``, ``bool`` or ``str`` only, or ``is_int(v)``), an order comparison of a
  value (a name, an attribute or an item; not a computed one as ``len(x)``) with a number or an
  upper-case constant (``v < 0``, ``not v > 0``, ``n > MAX_X``), or a value's membership in a
  literal tuple, list or set or an upper-case constant (``v not in ("a", "b")``, ``v not in KINDS``).
  Such a check belongs in ``core/checks.py`` (``check_int``, ``check_int_text``, ``check_seconds``,
  ``check_choice``, ``check_name``, ``check_type``, ``check_bool``, ``check_weights``), which words
  its errors one way.

Where a violation remains, in a file whose change is under way, it is listed below as a known
exception, by file and function (or name), never by line. The lists may only shrink: a new
violation fails, and so does a listed one that is gone (take it off the list).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
FOLDERS = ("core", "server", "client", "tools", "harness", "demos", "integrations", "data")
PACKAGE_OF = {"core": "croupier.core", "server": "croupier.server", "client": "croupier.client", "tools": "croupier.tools",
              "harness": "croupier.harness", "demos": "croupier.demos", "integrations": "croupier.integrations",
              "data": "croupier.data"}
LONGEST_FILE = 500
LONGEST_FUNCTION = 80
CHECKS = "core/checks.py"
PLAIN_TYPES = {"int", "float", "bool", "str"}


def sources(root: pathlib.Path = ROOT) -> dict[str, ast.Module]:
    """Every module of the packages' folders, parsed, by its path from the root."""
    out: dict[str, ast.Module] = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            if "__pycache__" not in path.parts:
                rel = path.relative_to(root).as_posix()
                out[rel] = ast.parse(path.read_text(), rel)
    return out


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) of every function in `tree`, nested ones included."""
    out: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((f"{prefix}{node.name}", node))
            out += _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            out += _functions(node, f"{prefix}{node.name}.")
        else:
            out += _functions(node, prefix)
    return out


def long_files(root: pathlib.Path = ROOT) -> set[str]:
    """The modules over LONGEST_FILE lines."""
    return {rel for rel in sources(root) if len((root / rel).read_text().splitlines()) > LONGEST_FILE}


def long_functions(root: pathlib.Path = ROOT) -> set[str]:
    """'file::qualified.name' of every function over LONGEST_FUNCTION lines."""
    return {f"{rel}::{name}" for rel, tree in sources(root).items() for name, fn in _functions(tree)
            if (fn.end_lineno or fn.lineno) - fn.lineno + 1 > LONGEST_FUNCTION}


def _module_name(rel: str) -> str:
    """'client/_base.py' -> 'croupier.client._base'; a package's __init__ is the package."""
    folder, _, rest = rel.partition("/")
    parts = [PACKAGE_OF[folder], *rest[:-3].split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def private_reads(root: pathlib.Path = ROOT) -> set[str]:
    """'file: module._name' for every read of another croupier module's private name."""
    trees = sources(root)
    modules = {_module_name(rel): rel for rel in trees}
    out: set[str] = set()
    for rel, tree in trees.items():
        me = _module_name(rel)
        package = me if rel.endswith("__init__.py") else me.rpartition(".")[0]
        aliases: dict[str, str] = {}  # a name in this file -> the croupier module it names
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])])
                for a in node.names:
                    full = f"{base}.{a.name}"
                    if full in modules:
                        aliases[a.asname or a.name] = full
                    elif base in modules and base != me and a.name.startswith("_") and not a.name.startswith("__"):
                        out.add(f"{rel}: {base}.{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in modules:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and f"{aliases[node.value.id]}.{node.attr}" not in modules and aliases[node.value.id] != me):
                out.add(f"{rel}: {aliases[node.value.id]}.{node.attr}")
    return out


def _is_value(node: ast.AST) -> bool:
    """A value as a check takes it: a name, an attribute or an item (not a computed one, as ``len(x)``)."""
    return isinstance(node, (ast.Name, ast.Attribute, ast.Subscript))


def _is_bound(node: ast.AST) -> bool:
    """A number, or an upper-case constant (``MAX_LEASE_BATCHES``, ``cfg.LIMIT``)."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return bool(name) and name.isupper()


def _asks_a_check(test: ast.AST) -> bool:
    """Whether an if's test asks what core/checks.py answers (see the module's docstring)."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _asks_a_check(test.operand)
    if isinstance(test, ast.BoolOp):
        return any(_asks_a_check(v) for v in test.values)
    if isinstance(test, ast.Call) and isinstance(test.func, ast.Name):
        if test.func.id == "is_int":
            return True
        if test.func.id == "isinstance" and len(test.args) == 2:
            kinds = test.args[1].elts if isinstance(test.args[1], ast.Tuple) else [test.args[1]]
            return all(isinstance(k, ast.Name) and k.id in PLAIN_TYPES for k in kinds)
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        op, left, right = test.ops[0], test.left, test.comparators[0]
        if isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)):
            return (_is_value(left) and _is_bound(right)) or (_is_bound(left) and _is_value(right))
        if isinstance(op, (ast.In, ast.NotIn)) and _is_value(left):
            literal = isinstance(right, (ast.Tuple, ast.List, ast.Set)) and all(
                isinstance(e, ast.Constant) for e in right.elts)
            return literal or (isinstance(right, ast.Name) and right.id.isupper())
    return False


def _raises_a_value_error(body: list[ast.stmt]) -> bool:
    """Whether `body` raises ValueError or TypeError with a message that says what a value "must be"."""
    for stmt in body:
        if isinstance(stmt, ast.Raise) and isinstance(stmt.exc, ast.Call):
            exc = stmt.exc.func
            words = " ".join(str(n.value) for a in stmt.exc.args for n in ast.walk(a)
                             if isinstance(n, ast.Constant) and isinstance(n.value, str))
            if isinstance(exc, ast.Name) and exc.id in ("ValueError", "TypeError") and "must be" in words:
                return True
    return False


def value_checks(root: pathlib.Path = ROOT) -> set[str]:
    """'file::function' of every value check outside core/checks.py ('file::<module>' at the top level)."""
    out: set[str] = set()
    for rel, tree in sources(root).items():
        if rel == CHECKS:
            continue
        owner = {id(n): name for name, fn in _functions(tree) for n in ast.walk(fn)}  # innermost wins: walked last
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and _raises_a_value_error(node.body) and _asks_a_check(node.test):
                out.add(f"{rel}::{owner.get(id(node), '<module>')}")
    return out


# ------------------------------------------------------------------ the known exceptions, and the tests

#: Files over 500 lines (split each by what it holds, then take it off the list).
KNOWN_LONG_FILES: set[str] = set()
#: Functions over 80 lines.
KNOWN_LONG_FUNCTIONS: set[str] = set()
#: Reads of another module's private names.
KNOWN_PRIVATE_READS: set[str] = set()
#: Value checks outside core/checks.py.
KNOWN_VALUE_CHECKS: set[str] = set()


def unexpected(found: set[str], known: set[str], what: str) -> list[str]:
    """What breaks a limit: a violation not in the known list, and a listed one that is gone (the list
    may only shrink: take it off)."""
    return ([f"{v}: {what}" for v in sorted(found - known)]
            + [f"{v}: listed as a known exception but gone: take it off the list" for v in sorted(known - found)])


def test_no_file_is_over_500_lines() -> None:
    assert unexpected(long_files(), KNOWN_LONG_FILES, f"over {LONGEST_FILE} lines") == []


def test_no_function_is_over_80_lines() -> None:
    assert unexpected(long_functions(), KNOWN_LONG_FUNCTIONS, f"over {LONGEST_FUNCTION} lines") == []


def test_no_module_reads_another_modules_private_names() -> None:
    assert unexpected(private_reads(), KNOWN_PRIVATE_READS, "a private name read from another module") == []


def test_values_are_checked_only_in_core_checks() -> None:
    assert unexpected(value_checks(), KNOWN_VALUE_CHECKS, "a value checked outside core/checks.py") == []


def test_a_known_exception_that_is_gone_fails() -> None:
    assert unexpected({"a.py"}, {"a.py", "b.py"}, "long") == ["b.py: listed as a known exception but gone: take it off the list"]
    assert unexpected({"a.py", "c.py"}, {"a.py"}, "long") == ["c.py: long"]


def _plant(root: pathlib.Path, files: dict[str, str]) -> None:
    for folder in FOLDERS:
        (root / folder).mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        (root / rel).write_text(text)


def test_the_length_checks_can_fail(tmp_path: pathlib.Path) -> None:
    def body(n: int, indent: int) -> str:
        return "".join(f"{' ' * indent}x{i} = {i}\n" for i in range(n))

    _plant(tmp_path, {
        "core/long.py": "x = 1\n" * 501,
        "core/ok.py": "x = 1\n" * 500,
        "tools/f.py": (f"def fits():\n{body(79, 4)}\n\nclass C:\n    def over(self):\n{body(80, 8)}\n\n"
                       f"def outer():\n    def inner():\n{body(79, 8)}        return 1\n    return inner\n"),
    })
    assert long_files(tmp_path) == {"core/long.py"}
    # fits: 80 lines; C.over: 81; inner: 81, and outer, which holds it, 83
    assert long_functions(tmp_path) == {"tools/f.py::C.over", "tools/f.py::outer", "tools/f.py::outer.inner"}


def test_the_private_name_check_can_fail(tmp_path: pathlib.Path) -> None:
    _plant(tmp_path, {
        "core/a.py": "_x = 1\n\ndef _f():\n    return _x\n",  # its own: allowed
        "core/_b.py": "",
        "core/c.py": "from croupier.core.a import _f, public\nfrom croupier.core import _b\nfrom . import a as mod\n"
                     "import croupier.core.a as other\n\ndef g(obj):\n    return mod._x, other._f, obj._y, _b, mod.__doc__\n",
        "server/d.py": "from croupier.core import a\n\ndef h():\n    return a._x\n",
    })
    assert private_reads(tmp_path) == {"core/c.py: croupier.core.a._f", "core/c.py: croupier.core.a._x",
                                       "server/d.py: croupier.core.a._x"}


def test_the_value_check_check_can_fail(tmp_path: pathlib.Path) -> None:
    _plant(tmp_path, {
        "core/checks.py": "def check(v):\n    if v < 0:\n        raise ValueError(f'v must be >= 0 (got {v})')\n",
        "client/x.py": (
            "def a(v):\n    if not v > 0:\n        raise ValueError(f'v must be > 0 (got {v})')\n\n"
            "def b(kind):\n    if kind not in ('x', 'y'):\n        raise ValueError(f'kind must be x or y (got {kind})')\n\n"
            "class C:\n    def __post_init__(self):\n        if not isinstance(self.n, int):\n"
            "            raise TypeError('n must be an int')\n\n"
            "def ok(parts, n):\n"
            "    if len(parts) > 1:\n        raise ValueError(f'parts must be one epoch (got {len(parts)})')\n"
            "    if n > 1:\n        raise ValueError('two ranks and no process group to agree on their incarnation')\n"
            "    if isinstance(parts, (bytes, str)):\n        raise TypeError('parts must be a list of records')\n"
        ),
    })
    assert value_checks(tmp_path) == {"client/x.py::a", "client/x.py::b", "client/x.py::C.__post_init__"}
