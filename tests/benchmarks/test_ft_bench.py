"""The torchft cost benchmark (`benchmarks/ft_bench.py`): its quick run's table, and its count of the loaders' calls."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from croupier.integrations.torchft import StepLoader
from croupier.server._service import Server

pytestmark = pytest.mark.e2e  # a coordinator process and a group process beside the benchmark's

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "ft_bench.py"
ROWS = ("attempts (committed)", "calls per committed step per group", "calls per committed step per rank (1 rank per group)",
        "calls on the training thread", "steps in the coordinator's record / committed (warm-up included)",
        "`next(loader)` p50 / p99 (indices only)", "`should_commit` hook p50 / p99",
        "added per step (next + hook) p50 / p99, all groups in this process",
        "the same, CPU time of the training thread (no wait for the GIL or a core)",
        "group 0 in a process of its own: added per step p50 / p99", "the same, CPU time of its training thread",
        "group 0 in a process of its own: calls per committed step (training thread)",
        "coordinator CPU per committed step",
        "coordinator CPU per report (per empty gRPC call: health `Check`, same server)",
        "coordinator RSS (growth over the attempts)",
        "peer: torchft `DistributedSampler` + `DataLoader` `next()`, p50 / p99 (no calls)",
        "StepLoader over the peer, p50 / p99 (above 1: the peer is cheaper)")


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ft_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _cells(text: str, name: str) -> list[str]:
    line = next(ln for ln in text.splitlines() if ln.startswith(f"| {name} |"))
    return [c.strip() for c in line.strip("|").split("|")][1:]


@pytest.mark.slow  # make slow, with the other benchmarks' quick runs of a minute's cost on these cores
def test_the_quick_run_prints_its_table_with_at_most_one_call_per_step_per_group(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| measure | 8 groups | 16 groups | 64 groups | target | met |" in proc.stdout, proc.stdout
    for name in ROWS:
        assert len(_cells(proc.stdout, name)) == 5, name  # three group counts, the target, met
    per_group = _cells(proc.stdout, "calls per committed step per group")
    assert all(0 < float(v) <= 1 for v in per_group[:3]) and per_group[3:] == ["<= 1", "met"], per_group
    assert _cells(proc.stdout, "calls on the training thread") == ["0", "0", "0", "0", "met"]
    own = _cells(proc.stdout, "group 0 in a process of its own: calls per committed step (training thread)")
    assert all(re.fullmatch(r"(0\.\d+|1\.000) \(0\)", v) for v in own[:3]) and own[4] == "met", own
    for cell in _cells(proc.stdout, "steps in the coordinator's record / committed (warm-up included)")[:3]:
        recorded, committed = cell.split(" / ")
        assert recorded == committed, cell  # every committed step reached the coordinator's record
    assert (tmp_path / "ft.md").read_text().strip() in proc.stdout


def test_the_count_sees_a_second_call_and_a_call_on_the_training_thread(server: Server,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _bench()
    ok = bench.measure(4, 12, 1000, server.address, os.getpid(), 0.0)
    assert ok.per_group() == 1.0 and ok.on_training_path() == 0 and ok.committed == 11
    assert ok.recorded == ok.committed + ok.warm_committed

    send = StepLoader._send

    def twice(self: StepLoader, c: object) -> None:
        send(self, c)  # type: ignore[arg-type]
        send(self, c)  # type: ignore[arg-type]

    monkeypatch.setattr(StepLoader, "_send", twice)
    assert bench.measure(4, 12, 1000, server.address, os.getpid(), 0.0).per_group() == 2.0

    def inline(self: StepLoader, c: object) -> None:  # reported on the training path
        assert self._client is not None
        self._client.commit_step(self.job, self.spec, self.run, self.parent, self.resumed, self.mode, self.batch, c)

    monkeypatch.setattr(StepLoader, "_send", inline)
    bad = bench.measure(4, 12, 1000, server.address, os.getpid(), 0.0)
    assert bad.on_training_path() == 4 * 11 and bad.per_group() == 1.0
