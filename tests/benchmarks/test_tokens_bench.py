"""Smoke run of the token-budget benchmark (`benchmarks/tokens_bench.py --quick`), so that it keeps working."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.exhaustive  # a benchmark's quick run: in make test, not in make check

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "tokens_bench.py"


def test_tokens_bench_quick_prints_its_tables() -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("| token budget | sum |") for line in lines), proc.stdout
    assert any(line.startswith("| fixed batch_size=") for line in lines), proc.stdout
    assert any(line.startswith("| 100,000 |") for line in lines), proc.stdout
    assert any(line.startswith("Ratio first batch after resume") for line in lines), proc.stdout
    # no token-budget batch goes over the budget
    assert all(line.split("|")[6].strip() == "0.0%" for line in lines if line.startswith("| token budget |"))
