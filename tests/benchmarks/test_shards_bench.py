"""Smoke run of the shards benchmark (`benchmarks/shards_bench.py --quick`: croupier alone, tiny shards), so that it keeps
working; its figures are not checked, but croupier's rows must come whole on a resume on fewer ranks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # torchrun ranks with DataLoader workers

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "shards_bench.py"


@pytest.mark.slow  # make slow: 20 s of torchrun ranks; tests/e2e/test_shard_reads.py runs the same reads in the suite
def test_shards_bench_quick_writes_its_table(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "shards_e2e.md").read_text()
    assert "## Targets" in text, text
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines() if line.startswith("| croupier |")]
    assert rows, text
    for row in rows:
        # samples/s and first batch measured; no row received twice or never, before and after the resume
        assert float(row[2].replace(",", "")) > 0, row
        assert row[5].endswith(" s"), row
        assert row[6] == "0 / 0 (0 / 0)", row
