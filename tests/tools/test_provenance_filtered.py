"""`croupier provenance --index I --logdir LOGDIR`: the epochs in which a packed run's filter rejected I, beside the ledger."""

from __future__ import annotations

import json
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _packing_data import Docs, run_world
from _provenance_run import run_cli
from torch.utils.data import DataLoader

from croupier.client import DistributedSampler, Indexed, PackedLoader
from croupier.core.answers import Occurrence
from croupier.server._service import Server
from croupier.tools.audit import audit, render
from croupier.tools.provenance import index_lines
from croupier.tools.provenance_filtered import FilteredAt
from croupier.tools.provenance_filtered import index_lines as filtered_lines

SEQ_LEN = 16
LENGTHS = [(i * 29) % 40 + 1 for i in range(48)]
EPOCH0 = frozenset(i for i in range(48) if i % 7 == 3)  # rejected by the filter of epoch 0
EPOCH1 = frozenset(i for i in range(48) if i % 5 == 1)  # rejected by the filter of epoch 1 (31 in both)


@pytest.fixture(scope="module")
def run() -> Iterator[tuple[str, str, Path]]:
    """Epoch 0: 2 ranks x 2 workers cut after 3 rows, resumed by 3 ranks x 1 worker to the epoch's end;
    epoch 1: 1 rank, another filter. Every rank writes its audit log."""
    with tempfile.TemporaryDirectory() as d:
        server = Server(f"sqlite:///{Path(d) / 'coordinator.db'}").start()
        try:
            job, logdir = uuid.uuid4().hex, Path(d) / "audit"
            docs, args = Docs(LENGTHS), {"audit_dir": str(logdir)}

            def keep0(i: int, tokens: Any) -> bool:
                return i not in EPOCH0

            _, states = run_world(server.address, job, docs, 2, 2, SEQ_LEN, 3, None, sampler_args=args,
                                  pack="best_fit", buffer=3, keep=keep0)
            _, ends = run_world(server.address, job, docs, 3, 1, SEQ_LEN, None, states[0], sampler_args=args,
                                pack="best_fit", buffer=3, keep=keep0)
            s = DistributedSampler(len(docs), num_replicas=1, rank=0, address=server.address, job=job, seed=3,
                                   tail="uneven", incarnation=uuid.uuid4().hex, audit_dir=str(logdir))
            try:
                packed = PackedLoader(DataLoader(Indexed(docs), batch_size=None, sampler=s), s, SEQ_LEN,
                                      keep=lambda i, tokens: i not in EPOCH1)
                packed.load_state_dict(ends[0])
                s.set_epoch(1)
                trained = {p[0] for b in packed for row in b.pieces for p in row}
            finally:
                s.close()
            assert trained == set(range(48)) - EPOCH1
            yield server.address, job, logdir
        finally:
            server.stop(grace=0.5)


def _filtered(address: str, job: str, index: int, *extra: str) -> list[dict[str, Any]]:
    code, out, err = run_cli("provenance", job, "--index", str(index), "--json", "--address", address, *extra)
    assert (code, err) == (0, ""), err
    return [o for o in json.loads(out) if o.get("filtered")]


def test_an_index_says_filtered_in_the_epochs_it_was_filtered_and_the_others_do_not(
        run: tuple[str, str, Path]) -> None:
    address, job, logdir = run
    lost = []
    for i in range(48):
        got = _filtered(address, job, i, "--logdir", str(logdir))
        lost += [o for o in got if not o["kept"]]
        kept = sorted(o["epoch"] for o in got if o["kept"])
        want = [e for e, rejected in ((0, EPOCH0), (1, EPOCH1)) if i in rejected]
        assert kept == want, (i, got)  # once in each epoch it was filtered in, counted as croupier audit counts
        assert all(o["epoch"] == 0 and o["generation"] == 1 for o in got if not o["kept"]), got  # lost with the cut
        assert all(set(o) >= {"epoch", "rank", "generation", "incarnation", "at"} for o in got)
    assert lost  # generation 1 filtered a document past the cut its successor resumed from: dealt again, filtered again
    reports = audit(logdir)
    assert [(r.epoch, r.filtered, r.missing, r.duplicates) for r in reports] == [
        (0, len(EPOCH0), 0, 0), (1, len(EPOCH1), 0, 0)], render(reports)


def test_as_text_a_filtered_index_is_not_never_trained(run: tuple[str, str, Path]) -> None:
    address, job, logdir = run
    code, out, err = run_cli("provenance", job, "--index", "31", "--logdir", str(logdir), "--address", address)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].startswith(f"job {job!r}, index 31: filtered ") and lines[0].endswith("in epochs 0, 1"), out
    assert lines[1].split() == ["EPOCH", "RANK", "ITEM", "GENERATION", "INCARNATION"]
    assert [ln.split()[0] for ln in lines[2:] if ln.split()[-1] == "filtered"] == ["0", "1"]
    assert "never trained" not in out
    code, out, _ = run_cli("provenance", job, "--index", "2", "--logdir", str(logdir), "--address", address)
    assert code == 0 and "filtered" not in out  # never filtered: the ledger's answer alone


def test_the_audit_dir_variable_is_read_and_without_logs_nothing_is_filtered(
        run: tuple[str, str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    address, job, logdir = run
    assert _filtered(address, job, 3) == []  # the ledger alone cannot say it
    monkeypatch.setenv("CROUPIER_AUDIT_DIR", str(logdir))
    assert [o["epoch"] for o in _filtered(address, job, 3) if o["kept"]] == [0]
    monkeypatch.setenv("CROUPIER_AUDIT_DIR", str(tmp_path))  # no log of this job there: the ledger's answer
    assert _filtered(address, job, 3) == []


def test_what_logdir_refuses(run: tuple[str, str, Path], tmp_path: Path) -> None:
    address, job, logdir = run
    code, out, err = run_cli("provenance", job, "--step", "1", "--logdir", str(logdir), "--address", address)
    assert (code, out) == (2, "")
    assert err == f"croupier provenance: error: --logdir {logdir} reads the filtered samples of an index: it needs --index\n"
    code, out, err = run_cli("provenance", job, "--index", "3", "--logdir", str(tmp_path), "--address", address)
    assert (code, out) == (1, "")
    assert err == f"croupier provenance: no audit logs of job {job!r} under {tmp_path} (jobs logged there: none)\n"


def test_the_ledgers_occurrences_follow_the_rejections() -> None:
    """A run whose steps the ledger places: its occurrences (where the sampler dealt the index) come after."""
    occ = [Occurrence(0, 4, 1, 1, 0, True, 0, 0)]
    ledger = index_lines("j", 5, None, occ)
    lines = filtered_lines("j", 5, None, occ, [FilteredAt(0, 1, 1, 7, "a", True, 0),
                                               FilteredAt(0, 1, 0, 9, "a", False, 0)], ledger)
    assert lines[0] == "job 'j', index 5: filtered 2 times (1 kept, 1 abandoned), in epoch 0"
    assert [ln.split()[-1] for ln in lines[2:4]] == ["filtered", "ABANDONED"]
    assert lines[4].startswith("the step ledger") and lines[5:] == ledger
    assert filtered_lines("j", 5, None, occ, [], ledger) == ledger



def _mixture_filtered(address: str, job: str, logdir: Path, i: int, source: int) -> list[dict[str, Any]]:
    code, out, err = run_cli("provenance", job, "--index", str(i), "--source", str(source), "--json",
                             "--logdir", str(logdir), "--address", address)
    assert (code, err) == (0, ""), err
    return [o for o in json.loads(out) if o.get("filtered")]


def test_a_mixtures_sample_is_asked_within_its_source(tmp_path: Path) -> None:
    """--source S: sample I of source S is the index the sampler dealt after the sources before it (24 + I for
    source 1); every rejection the audit counts is found so, and no sample that was not rejected is."""
    with tempfile.TemporaryDirectory() as d:
        server = Server(f"sqlite:///{Path(d) / 'coordinator.db'}").start()
        try:
            job = uuid.uuid4().hex
            run_world(server.address, job, Docs(LENGTHS), 2, 0, SEQ_LEN, None, None, pack="greedy",
                      sampler_args={"audit_dir": str(tmp_path), "weights": [0.5, 0.5], "sources": [24, 24]},
                      keep=lambda i, tokens: i not in EPOCH0)
            found = 0
            for i in range(24):
                for source in (0, 1):
                    got = _mixture_filtered(server.address, job, tmp_path, i, source)
                    assert all(o["source"] == source and o["epoch"] == 0 and o["kept"] for o in got), got
                    assert not got or source * 24 + i in EPOCH0, (i, source, got)
                    found += len(got)
            assert found == sum(r.filtered for r in audit(tmp_path)) > 0, render(audit(tmp_path))
        finally:
            server.stop(grace=0.5)
