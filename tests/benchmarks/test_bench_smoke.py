"""Smoke run of the order benchmark program, so that it keeps working (its figures are not checked)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # several processes

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "order_bench.py"


def test_order_bench_quick_runs_and_prints_its_table() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = "| N | croupier feistel first batch (ms) | torch DistributedSampler first batch (ms) | torch / croupier"
    assert any(line.startswith(header) for line in lines), proc.stdout
    assert any(line.startswith("| 1,000,000,000 |") for line in lines), proc.stdout
    assert "vectorised rate, per core" in proc.stdout
