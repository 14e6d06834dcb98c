"""An older commit's coordinator beside this tree's: `croupier serve` run from REF's files, in the same benchmark run.

``with baseline("42a3d40") as old:`` exports REF's tree (``git archive``) into a temporary folder and
makes beside it a folder ``croupier/`` whose subpackages point at that tree's ``core server client
tools integrations`` and ``proto/croupier/v1`` (pyproject.toml's package-dir); with that folder first
on ``PYTHONPATH`` (``old.env``), ``python -m croupier.tools.cli serve`` runs REF's coordinator. Before
it yields, a child process with that environment prints ``croupier.server._service.__file__``, which
must be in the exported tree. The benchmarks' load drivers keep this tree's client.

    python benchmarks/baseline.py 42a3d40   # prints where REF's server is imported from
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: The last commit of the thread-per-call serving (gRPC's synchronous server); the commits after it serve on grpc.aio.
THREADED = "42a3d40"
#: The package's subpackages and the folders of the tree they are in (pyproject.toml's package-dir).
PACKAGE_DIRS = {"core": "core", "server": "server", "client": "client", "tools": "tools",
                "integrations": "integrations", "v1": "proto/croupier/v1"}
#: A join's long poll as each serving's client asks it: the threaded client polled 0.5 s, this tree's polls 5 s
#: (CoordinatorClient.join_started's poll_s).
POLL_MS_THREADED, POLL_MS = 500, 5000


@dataclasses.dataclass(frozen=True)
class Serving:
    """Which coordinator a benchmark starts: this tree's, or REF's.

    Attributes:
        name: ``new`` (this tree) or ``old`` (REF).
        label: How the results name it.
        env: Added to ``croupier serve``'s environment (REF's ``PYTHONPATH``).
        join_poll_ms: The join long poll its client asks (``wait_ms``).
        ref: REF's abbreviated commit (None: this tree).
    """

    name: str
    label: str
    env: dict[str, str]
    join_poll_ms: int
    ref: str | None = None

    def environ(self) -> dict[str, str]:
        """This process's environment with :attr:`env` over it (``PYTHONPATH`` put first)."""
        out = dict(os.environ)
        for key, value in self.env.items():
            out[key] = value + (os.pathsep + out[key] if key == "PYTHONPATH" and out.get(key) else "")
        return out


#: This tree's coordinator (grpc.aio), in the benchmarks' own environment.
CURRENT = Serving("new", "grpc.aio (this tree)", {}, POLL_MS)


def resolve(ref: str) -> str:
    """REF's abbreviated commit.

    Raises:
        ValueError: REF names no commit of this repository.
    """
    run = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "--verify", "--quiet", f"{ref}^{{commit}}"],
                         capture_output=True, text=True, check=False)
    if run.returncode != 0 or not run.stdout.strip():
        raise ValueError(f"--baseline {ref!r}: not a commit of the repository at {ROOT}")
    return run.stdout.strip()


def imported_server(env: dict[str, str]) -> pathlib.Path:
    """Where a Python started with `env` imports ``croupier.server._service`` from (symlinks resolved)."""
    run = subprocess.run([sys.executable, "-c", "import croupier.server._service as s; print(s.__file__)"],
                         capture_output=True, text=True, env=env, check=False, cwd=tempfile.gettempdir())
    if run.returncode != 0:
        raise RuntimeError(f"croupier.server._service does not import: {run.stderr[-2000:]}")
    return pathlib.Path(run.stdout.strip()).resolve()


@contextlib.contextmanager
def baseline(ref: str, join_poll_ms: int = POLL_MS_THREADED) -> Iterator[Serving]:
    """REF's coordinator: its tree exported into a temporary folder (removed on exit), and the environment that runs it.

    Raises:
        ValueError: REF names no commit.
        RuntimeError: The environment does not import REF's server.
    """
    sha = resolve(ref)
    # NOTE: an export (git archive), not a git worktree: nothing is registered in the repository, so a run
    # that is killed leaves nothing behind in .git, and the others' working tree and index are not touched.
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", sha], capture_output=True, check=True).stdout
    with tempfile.TemporaryDirectory(prefix=f"croupier-{sha}-") as tmp:
        tree, shim = pathlib.Path(tmp, "tree"), pathlib.Path(tmp, "shim", "croupier")
        with tarfile.open(fileobj=io.BytesIO(tar)) as t:
            t.extractall(tree, filter="data")
        shim.mkdir(parents=True)
        (shim / "__init__.py").write_text("")
        for sub, folder in PACKAGE_DIRS.items():
            (shim / sub).symlink_to(tree / folder, target_is_directory=True)
        serving = Serving("old", f"threads ({sha})", {"PYTHONPATH": str(shim.parent)}, join_poll_ms, sha)
        where = imported_server(serving.environ())
        if not where.is_relative_to(tree.resolve()):
            raise RuntimeError(f"the environment of {sha} imports croupier.server._service from {where}, not from {tree}")
        yield serving


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    with baseline(args[0] if args else THREADED) as old:
        print(f"{old.ref}: croupier.server._service from {imported_server(old.environ())}")
    print(f"this tree: croupier.server._service from {imported_server(CURRENT.environ())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
