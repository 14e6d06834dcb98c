"""Runs mypy on croupier's packages: strict on core, server, client and integrations, the defaults on tools.

The source folders (core/, server/, ...) install as croupier.core, croupier.server, ... through
setuptools' package-dir, which mypy cannot follow; so this lays out a tree of links named as the
packages are imported (croupier/core -> core/, ...) and points mypy at it.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINKS = {"core": "core", "server": "server", "client": "client", "tools": "tools", "integrations": "integrations",
         "v1": "proto/croupier/v1"}
STRICT = ["croupier.core", "croupier.server", "croupier.client", "croupier.integrations"]


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="croupier-mypy-") as tmp:
        pkg = pathlib.Path(tmp) / "croupier"
        pkg.mkdir()
        for name, folder in LINKS.items():
            (pkg / name).symlink_to(ROOT / folder, target_is_directory=True)
        env = {**os.environ, "MYPYPATH": tmp}
        base = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--explicit-package-bases"]
        codes = []
        strict = base + ["--strict"] + [a for p in STRICT for a in ("-p", p)]
        codes.append(subprocess.run(strict, cwd=tmp, env=env).returncode)
        codes.append(subprocess.run(base + ["-p", "croupier.tools"], cwd=tmp, env=env).returncode)
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
