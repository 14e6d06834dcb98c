"""Smoke run of the replica benchmark (`benchmarks/ha_bench.py --quick --baseline REF`), so that it keeps working; its
figures are not checked."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _postgres import unavailable_reason

pytestmark = pytest.mark.e2e  # PostgreSQL and several coordinator processes

HA_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "ha_bench.py"
#: The last commit of the threaded serving (benchmarks/baseline.py THREADED).
THREADED = "42a3d40"


@pytest.mark.slow  # make slow
def test_ha_bench_quick_writes_its_table(tmp_path: Path) -> None:
    reason = unavailable_reason()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the PostgreSQL tests, but {reason}")
        pytest.skip(f"PostgreSQL tests skipped: {reason}")
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(HA_BENCH), "--quick", "--baseline", THREADED, "--out", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    md = (out / "ha.md").read_text()
    header = ("| measure | load | SQLite, 1 replica | PostgreSQL, 1 replica | PostgreSQL, 2 replicas | "
              "PostgreSQL, 3 replicas |")
    assert header in md and header in proc.stdout
    new = md.split(header, 1)[1].split("\n\n", 1)[0]  # the new serving's table (the old one's and the ratios follow)
    rows = [line for line in new.splitlines() if line.startswith("| ")]
    for what, load in [("join commit p50", "1 at a time"), ("join commit p99", "1 at a time"), ("joins/s", "1 at a time"),
                       ("join commit p50", "16 at a time"), ("join commit p99", "16 at a time"),
                       ("joins/s", "16 at a time"), ("grants/s", "progress moved"), ("grant p99", "progress moved"),
                       ("grants/s", "progress unchanged"), ("grant p99", "progress unchanged")]:
        row = [r for r in rows if r.startswith(f"| {what} | ") and load in r]
        assert len(row) == 1, (what, load, rows)
        cells = [c.strip() for c in row[0].strip("|").split("|")]
        # Every configuration measured something: a figure, and a ratio beside SQLite's in the PostgreSQL columns.
        assert len(cells) == 6 and all(c and "nan" not in c for c in cells[2:]), row
        assert all(c.endswith("x)") for c in cells[3:]), row
    assert "failed calls" not in md, md
    # the old serving's table, the ratios new / old of every figure, and the grant rates beside their target
    assert f"The same on threads ({THREADED})'s coordinator" in md
    assert md.count("| measure | load | SQLite, 1 replica: old -> new |") == 1
    for config in ("SQLite, 1 coordinator", "PostgreSQL, 3 replicas"):
        for load in ("progress moved", "progress unchanged"):
            row = [r for r in md.splitlines() if r.startswith(f"| {config} | {load} | ")]
            assert len(row) == 1 and re.search(r"\| [\d.]+x \| no lower than old: (met|MISSED) \|$", row[0]), row
