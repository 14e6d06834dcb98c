"""The provenance benchmark's quick run (`benchmarks/provenance_bench.py --quick`): its table, and the three answers agreeing."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from croupier.core.ledger import Ledger

pytestmark = pytest.mark.exhaustive  # a benchmark's quick run: in make test, not in make check

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "provenance_bench.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("provenance_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_provenance_bench_quick_prints_its_table() -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = "| query | croupier | order file (memmap) | step log (msgpack records, offset index) | target | met |"
    assert header in lines, proc.stdout
    for row in ("| step T, p50 |", "| step T, p99 |", "| index I, p50 |", "| index I, p99 |", "| bytes at 1,500 steps |"):
        assert any(line.startswith(row) for line in lines), row
    assert "agree on all 1,500 steps (kept and abandoned versions) and on 50 indices" in proc.stdout
    assert "10 restarts, each a resize; 2 of them past a checkpoint" in proc.stdout


def test_the_ledger_and_the_peers_agree_and_a_difference_is_caught(tmp_path: Path) -> None:
    bench = _bench()
    p = dataclasses.replace(bench.QUICK, steps=300, prefix=48 * 300, generations=6, rollback_every=2)
    files = bench.Files(tmp_path, p.global_batch, p.steps)
    run = bench.build(p, bench.batch_by_batch(files))
    order, log = files.close()
    ledger = Ledger("bench", run.spec, run.segments)
    assert run.records > p.steps  # rollbacks left abandoned versions in the log
    abandoned = [t for t in range(1, p.steps + 1) if ledger.step(t).abandoned]
    assert abandoned and all(len(log.step(t)) > 1 for t in abandoned)
    bench.agree(ledger, order, log, list(range(1, p.steps + 1)), list(range(0, p.n, 5)))
    # The check can fail: one sample of a kept step changed in the order file, then in the step log.
    t = abandoned[0]
    mm = np.load(order.path, mmap_mode="r+")
    mm[(t - 1) * p.global_batch] ^= 1
    mm.flush()
    with pytest.raises(AssertionError, match=f"step {t}: the ledger and the order file differ"):
        bench.agree(ledger, bench.OrderFile(order.path, p.global_batch), log, [t], [])
    # ... and a ledger whose history lost what a generation trained past the checkpoint its successor resumed from
    segs = [dataclasses.replace(s) for s in run.segments]
    for prev, nxt in zip(segs, segs[1:]):
        assert nxt.step is not None
        prev.reached, prev.checkpoints = {}, [c for c in prev.checkpoints if c <= nxt.step]
    with pytest.raises(AssertionError, match="abandoned versions differ"):
        bench.agree(Ledger("bench", run.spec, segs), order, log, abandoned[1:], [])
