"""The loss-spike workflow end to end: examples/loss_spike.py's ranks (torchrun) on a `croupier serve` process, the
spike traced with `croupier provenance`, its samples skipped with `croupier skip --from`, the run resumed before it."""

from __future__ import annotations

import collections
import json
import pathlib
import subprocess
import sys
from typing import Any

import pytest
from _torchrun import torchrun
from conftest import ServeProcess

from croupier.tools.audit import load
from croupier.tools.provenance import ledger

pytestmark = pytest.mark.e2e

JOB = "loss-spike"
T = 20


def croupier(*args: str) -> str:
    """`croupier ARGS` as a user runs it; its stdout (it must exit 0 and print nothing on stderr)."""
    r = subprocess.run([sys.executable, "-m", "croupier.tools.cli", *args], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stderr) == (0, ""), f"croupier {' '.join(args)}: exit {r.returncode}\n{r.stderr}"
    return r.stdout


def _logged(work: pathlib.Path) -> dict[tuple[int, int], dict[int, list[int]]]:
    """What the ranks trained, from the example's --log-steps: (generation, step) -> rank -> indices."""
    out: dict[tuple[int, int], dict[int, list[int]]] = collections.defaultdict(dict)
    for rank in (0, 1):
        for line in (work / f"steps-r{rank}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            out[(rec["generation"], rec["step"])][rank] = rec["indices"]
    return out


def _by_rank(version: dict[str, Any]) -> dict[int, list[int]]:
    got: dict[int, list[int]] = collections.defaultdict(list)
    for b in version["batches"]:
        got[b["rank"]] += b["indices"]
    return dict(got)


def test_a_spike_is_traced_to_its_samples_which_are_skipped_and_the_run_resumed_before_it(
        tmp_path: pathlib.Path, serve_process: type[ServeProcess]) -> None:
    address = serve_process(f"sqlite:///{tmp_path}/coordinator.db").address
    run = ["--workdir", str(tmp_path), "--address", address, "--spike-at", str(T), "--log-steps"]
    out, _ = torchrun("loss_spike.py", 2, tmp_path, run)
    assert f"loss spike at step {T}:" in out and "the checkpoint before it is step 15" in out
    planted = json.loads((tmp_path / "planted.json").read_text())["indices"]

    # provenance of the steps before the spike finds the planted samples in step T alone
    window = json.loads(croupier("provenance", JOB, "--steps", f"{T - 2}:{T}", "--json", "--address", address))
    assert [r["step"] for r in window] == [T - 2, T - 1, T]
    where = {i: [r["step"] for r in window for b in r["kept"]["batches"] if i in b["indices"]] for i in planted}
    assert where == {i: [T] for i in planted}
    first = window[-1]["kept"]
    trained = _logged(tmp_path)
    assert _by_rank(first) == trained[(1, T)]  # the ledger's step T is what the ranks trained at step T

    # skip step T's samples, from provenance's JSON
    saved = tmp_path / f"step-{T}.json"
    saved.write_text(croupier("provenance", JOB, "--step", str(T), "--json", "--address", address))
    skipped_out = croupier("skip", JOB, "--from", str(saved), "--address", address)
    spiked = {i for b in first["batches"] for i in b["indices"]}
    assert len(skipped_out.splitlines()) == 1 + len(spiked)

    # resume from the checkpoint before the spike: no spike again
    out, _ = torchrun("loss_spike.py", 2, tmp_path, [*run, "--resume"])
    assert "resumed at step 15" in out and "trained to step 64: no loss spike" in out

    # the audit: every sample not skipped exactly once per (source) epoch
    audited = subprocess.run([sys.executable, "-m", "croupier.tools.cli", "audit", str(tmp_path / "audit")],
                             capture_output=True, text=True, timeout=120)
    assert audited.returncode == 0 and "G1 holds" in audited.stdout, audited.stdout + audited.stderr

    # the spike's samples were never trained again: not by the ranks (their audit logs), nor in the ledger
    incs = load(tmp_path / "audit")[JOB]
    assert [i.generation for i in incs] == [1, 2]
    again = {int(i) for rank in incs[1].ranks.values() for _, _, idx in rank.batches for i in idx}
    assert again and not again & spiked
    for i in planted:
        occ = json.loads(croupier("provenance", JOB, "--index", str(i), "--json", "--address", address))
        assert [(o["step"], o["generation"], o["kept"]) for o in occ] == [(T, 1, False)]

    # provenance of the new step T: what replaced them, beside the abandoned version
    text = croupier("provenance", JOB, "--step", str(T), "--address", address)
    assert f"job '{JOB}', step {T}: 2 versions" in text
    assert ", world 2, epoch 0: kept; 8 samples" in text.splitlines()[1] and "generation 2 " in text.splitlines()[1]
    assert sum("generation 1 " in ln and "ABANDONED" in ln for ln in text.splitlines()) == 1
    rec = json.loads(croupier("provenance", JOB, "--step", str(T), "--json", "--address", address))
    assert rec["kept"]["generation"] == 2 and [v["generation"] for v in rec["abandoned"]] == [1]
    assert rec["abandoned"][0]["batches"] == first["batches"]
    assert not {i for b in rec["kept"]["batches"] for i in b["indices"]} & spiked
    # every step, kept and abandoned, is what the ranks of its generation trained at that step
    led = ledger(address, JOB)
    assert led.last_step == 64
    trained = _logged(tmp_path)
    for t in range(1, 65):
        r = led.step(t)
        assert r.kept is not None and _by_rank(r.kept.to_dict()) == trained[(r.kept.generation, t)], f"step {t}"
        gone = [(1, trained[(1, t)])] if 15 < t <= T else []
        assert [(v.generation, _by_rank(v.to_dict())) for v in r.abandoned] == gone, f"step {t}"
