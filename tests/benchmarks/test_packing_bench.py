"""Smoke run of the packing benchmark (`benchmarks/packing_bench.py --quick`), so that it keeps working."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "packing_bench.py"


# NOTE: end to end: its throughput part runs a DataLoader with 4 worker processes (make test, not make check).
@pytest.mark.e2e
@pytest.mark.slow  # make slow; the packing stage's resumes are tests/e2e/test_packing_e2e.py and test_packing_peers_e2e.py
def test_packing_bench_quick_prints_its_tables() -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    rows = [line.split("|") for line in lines if line.startswith("| 1.0 |")]
    padding = {r[3].strip(): float(r[5].strip().rstrip("%")) for r in rows}
    # packing pads less than padding to the longest, and best-fit less than greedy
    assert padding["packed, best-fit, buffer 64"] < padding["packed, greedy"] < padding["pad to longest, 8 documents"], padding
    ratios = [line for line in lines if line.startswith(("| greedy |", "| best_fit |"))]
    assert len(ratios) == 2 and all("x** |" in r for r in ratios), proc.stdout
