"""MkDocs hook: lays the package's parts out as one ``croupier/`` tree, for the API reference.

The repository keeps ``croupier.client`` in ``client/``, ``croupier.core`` in ``core/`` and so on
(pyproject.toml's package-dir), and ``croupier`` itself is a namespace: the reference, which reads
the sources statically, reads them from a tree shaped like the package, ``out/api-src/croupier/<part>``,
each a symbolic link to the folder the installed package imports that part from.
"""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PARTS = ("client", "core", "data", "demos", "harness", "integrations", "server", "tools", "v1")


def on_startup(command: str, dirty: bool) -> None:
    """Before any plugin's configuration: mkdocstrings looks for its ``paths`` when it is configured."""
    tree = ROOT / "out" / "api-src" / "croupier"
    tree.mkdir(parents=True, exist_ok=True)
    for part in PARTS:
        spec = importlib.util.find_spec(f"croupier.{part}")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"croupier.{part} is not importable: install the project first (make site does)")
        target = pathlib.Path(list(spec.submodule_search_locations)[0]).resolve()
        link = tree / part
        if link.is_symlink() and link.resolve() == target:
            continue
        if link.is_symlink():
            link.unlink()
        link.symlink_to(target, target_is_directory=True)
