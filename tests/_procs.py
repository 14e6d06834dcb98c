"""What a multi-process run left behind: the processes of this machine that still name it."""

from __future__ import annotations

import os
import pathlib


def processes_naming(*needles: str) -> list[str]:
    """Processes (other than this one) whose command line or environment mentions one of `needles` (a
    workdir, a database's URL or directory), each as ``"PID: command line"``."""
    found = []
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            seen = (d / "cmdline").read_bytes() + (d / "environ").read_bytes()
        except OSError:
            continue  # gone, or not ours
        if any(n.encode() in seen for n in needles):
            found.append(f"{d.name}: {(d / 'cmdline').read_bytes().replace(bytes(1), b' ').decode(errors='replace')}")
    return found
