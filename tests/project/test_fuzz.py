"""A short run of the wire fuzzer (fuzz/rpc_fuzz.py; `make fuzz` runs it ten minutes), and a check that it can fail."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("atheris", reason="atheris has wheels for Linux x86-64 only")
pytestmark = pytest.mark.e2e  # a process of its own, on one core
FUZZ = pathlib.Path(__file__).resolve().parents[2] / "fuzz" / "rpc_fuzz.py"


def _run(tmp: pathlib.Path, *args: str, env: dict[str, str] | None = None) -> str:
    """The fuzzer's output (stdout and stderr: a finding goes to either), its exit code first."""
    import os

    run = subprocess.run([sys.executable, str(FUZZ), f"-artifact_prefix={tmp}/", *args], capture_output=True, text=True,
                         timeout=300, env={**os.environ, **(env or {})})
    return f"exit {run.returncode}\n{run.stdout}{run.stderr}"


def test_every_rpc_survives_a_short_fuzz_run(tmp_path: pathlib.Path) -> None:
    out = _run(tmp_path, "-runs=4000", "-seed=1")
    assert out.startswith("exit 0\n"), out[-4000:]
    outcomes = out.rsplit("outcomes: ", 1)[1].splitlines()[0]
    assert "'ok'" in outcomes and "'INVALID_ARGUMENT'" in outcomes, outcomes  # it reached past the parse


def test_the_fuzzer_reports_a_refusal_that_changed_the_state(tmp_path: pathlib.Path) -> None:
    """With a planted fault (a refused call that registers its job first), the run stops with the finding."""
    out = _run(tmp_path, "-runs=4000", "-seed=1", env={"CROUPIER_FUZZ_PLANT": "1"})
    assert not out.startswith("exit 0\n") and "was refused" in out and "changed the state" in out, out[-3000:]
    assert list(tmp_path.glob("crash-*")), "the finding's input was not kept"
