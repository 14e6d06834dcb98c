"""Smoke run of the start, stride and lease benchmark (`benchmarks/stride_bench.py --quick`), so that it keeps working."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.exhaustive  # a benchmark's quick run: in make test, not in make check

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "stride_bench.py"


def test_stride_bench_quick_writes_its_table(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    table = (tmp_path / "stride.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith(("| what", "| ---"))]
    for what in ("start: first batch, one rank", "start: first batch, 8 ranks in one process", "stride: indices/s",
                 "leases: latency p50 / p99, one rank", "leases: latency p50 / p99, paced", "leases: rate, saturated"):
        assert any(row.startswith(f"| {what}") for row in rows), table
    # every row with a target says where it stands
    assert all(("met" in row or "MISSED" in row) for row in rows if not row.endswith("|  |")), table
