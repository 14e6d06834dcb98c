"""`benchmarks/straggler_bench.py --quick`: with one slow rank, dynamic dealing finishes the epoch before static dealing."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # several processes

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "straggler_bench.py"
ROW = re.compile(r"^\| (?P<mode>static|dynamic) \(.*?\) \| (?P<seconds>[\d.]+) \| (?P<ideal>[\d.]+) \| (?P<ratio>[\d.]+) \| "
                 r"(?P<batches>[\d / ]+) \| [\d./ ]+ \| (?P<once>yes|NO) \|$", re.M)


@pytest.mark.slow  # make slow
def test_dynamic_dealing_beats_static_with_a_straggler(tmp_path: Path) -> None:
    began = time.monotonic()
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=300, check=False)
    seconds = time.monotonic() - began
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {m["mode"]: m for m in ROW.finditer(proc.stdout)}
    assert set(rows) == {"static", "dynamic"}, proc.stdout
    static, dynamic = rows["static"], rows["dynamic"]
    assert static["once"] == dynamic["once"] == "yes"
    assert float(dynamic["seconds"]) < float(static["seconds"]), proc.stdout
    # static: fixed stripes, the same count on every rank; dynamic: the slow rank (3) was dealt fewer
    assert len(set(static["batches"].split(" / "))) == 1
    fast, slow = [int(x) for x in dynamic["batches"].split(" / ")[:3]], int(dynamic["batches"].split(" / ")[3])
    assert slow < min(fast), proc.stdout
    assert "target: dynamic within 10% of ideal" in proc.stdout
    assert (tmp_path / "straggler.md").read_text().strip() in proc.stdout
    print(f"--quick took {seconds:.0f} s")
