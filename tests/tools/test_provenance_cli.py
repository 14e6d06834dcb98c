"""`croupier provenance` against a real coordinator: steps, ranges and indices as text and JSON, and its errors."""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys
from typing import Any

import pytest
from _provenance_run import generation, run_cli

from croupier.client import CoordinatorClient
from croupier.core.errors import OutOfRange
from croupier.server import Server
from croupier.tools import provenance as prov

SOURCES = (64, 32)


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A mixture job: generation 1 (2 ranks) trains steps 1-10 (checkpoints at 4 and 10); generation 2 (3 ranks)
    resumes from step 4 and trains 5-7 (checkpoint at 7): steps 5-10 of generation 1 are abandoned."""
    d = tmp_path_factory.mktemp("prov")
    server = Server(f"sqlite:///{d}/c.db").start()
    try:
        saved = generation(server.address, "mix", "a", 2, 10, dataset=SOURCES, save_at=(4, 10))
        later = generation(server.address, "mix", "b", 3, 3, dataset=SOURCES, resume=saved[4], save_at=(7,))
        with CoordinatorClient(server.address) as c:
            led = c.ledger("mix")
        yield server, led, saved, later
    finally:
        server.stop(grace=0.5)


def test_the_ledger_holds_the_rollback(history: Any) -> None:
    _, led, _, _ = history
    assert led.last_step == 7 and led.furthest_step == 10
    assert [(s["generation"], s["from_step"], s["kept_to"]) for s in led.timeline()] == [(1, 0, 4), (2, 4, 7)]


def test_a_step_as_text_lists_the_kept_version_and_the_abandoned_one(history: Any) -> None:
    server, led, _, _ = history
    code, out, err = run_cli("provenance", "mix", "--step", "6", "--address", server.address)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "job 'mix', step 6: 2 versions"
    assert lines[1] == "  generation 2 (b), world 3, epoch 0: kept; 12 samples"
    assert lines[2].split() == ["RANK", "MICRO", "INDEX", "SOURCE", "SOURCE", "EPOCH", "SEED"]
    rec = led.step(6)
    assert rec.kept is not None and len(rec.abandoned) == 1
    kept = [ln.split() for ln in lines[3:15]]
    want = [[str(b.rank), str(b.micro), str(int(i)), str(int(s)), str(int(e)), str(int(x))]
            for b in rec.kept.batches for i, s, e, x in zip(b.indices, b.sources, b.source_epochs, b.seeds, strict=True)]
    assert kept == want
    assert lines[15].startswith("  generation 1 (a), world 2, epoch 0: ABANDONED")
    assert [ln.split()[2] for ln in lines[17:]] == [str(int(i)) for i in rec.abandoned[0].indices]


def test_json_is_the_ledgers_answers(history: Any) -> None:
    server, led, _, _ = history
    code, out, _ = run_cli("provenance", "mix", "--step", "9", "--json", "--address", server.address)
    assert code == 0 and json.loads(out) == led.step(9).to_dict()  # abandoned only, past the timeline's end
    assert json.loads(out)["kept"] is None
    code, out, _ = run_cli("provenance", "mix", "--steps", "3:5", "--json", "--address", server.address)
    assert code == 0 and json.loads(out) == [led.step(t).to_dict() for t in (3, 4, 5)]
    code, out, _ = run_cli("provenance", "mix", "--steps", "6:", "--json", "--address", server.address)
    assert code == 0 and [r["step"] for r in json.loads(out)] == [6, 7]
    code, out, _ = run_cli("provenance", "mix", "--json", "--address", server.address)
    assert code == 0 and json.loads(out) == {"job": "mix", "last_step": 7, "global_batch": None,
                                             "timeline": led.timeline()}


def test_an_index_lists_every_place_it_was_trained(history: Any) -> None:
    server, led, _, _ = history
    abandoned = led.step(9).abandoned[0].batches[1]
    i, source = int(abandoned.indices[0]), int(abandoned.sources[0])
    code, out, _ = run_cli("provenance", "mix", "--index", str(i), "--json", "--address", server.address)
    occ = json.loads(out)
    assert code == 0 and occ == [o.to_dict() for o in led.index(i)]
    assert any((o["step"], o["rank"], o["generation"], o["kept"]) == (9, 1, 1, False) for o in occ)
    within = i - (0 if source == 0 else SOURCES[0])
    code, out, _ = run_cli("provenance", "mix", "--index", str(within), "--source", str(source), "--json",
                           "--address", server.address)
    assert code == 0 and json.loads(out) == occ
    code, out, _ = run_cli("provenance", "mix", "--index", str(i), "--address", server.address)
    assert code == 0 and out.startswith(f"job 'mix', index {i}: trained {len(occ)} times")
    assert sum("ABANDONED" in ln for ln in out.splitlines()) == sum(not o["kept"] for o in occ)


def test_the_timeline_without_a_question(history: Any) -> None:
    server, _, _, _ = history
    code, out, _ = run_cli("provenance", "mix", "--address", server.address)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "job 'mix': 7 steps on its timeline, of different sizes (a resize, a ramp-up or token budgets)"
    assert lines[1].split() == ["GENERATION", "INCARNATION", "WORLD", "EPOCH", "STEPS", "KEPT", "GLOBAL", "BATCH",
                                "AMENDMENTS"]
    assert lines[2].split() == ["1", "a", "2", "0", "1..10", "to", "step", "4", "-", "-"]
    assert lines[3].split() == ["2", "b", "3", "0", "5..7", "to", "step", "7", "-", "-"]


def test_the_compact_text_of_a_large_step_says_what_it_left_out(history: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _, led, _, _ = history
    monkeypatch.setattr(prov, "SHOWN", 5)
    lines = prov.step_lines("mix", led.step(6), mixture=True)
    assert "    ... 7 more samples (--full prints every one, --json all of it)" in lines
    assert len(prov.step_lines("mix", led.step(6), mixture=True, full=True)) == 1 + 2 * 2 + 12 + 8


def test_the_python_function_answers_the_same(history: Any) -> None:
    server, led, _, _ = history
    assert prov.provenance(server.address, "mix", step=6).to_dict() == led.step(6).to_dict()
    assert [r.step for r in prov.provenance(server.address, "mix", steps=(2, 3))] == [2, 3]
    assert prov.provenance(server.address, "mix", index=5) == led.index(5)
    with pytest.raises(OutOfRange, match="step 11 is past the run"):
        prov.provenance(server.address, "mix", step=11)
    with pytest.raises(ValueError, match="one question"):
        prov.provenance(server.address, "mix")  # type: ignore[call-overload]


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--step", "0"], 2, "step must be an int >= 1"),
    (["--step", "-3"], 2, "step must be an int >= 1 (steps count from 1, as the trainers log them; got -3)"),
    (["--step", "11"], 1, "step 11 is past the run: job 'mix' has trained 7 steps"),
    (["--steps", "5"], 2, "--steps takes FIRST:LAST or FIRST: (steps count from 1; got '5')"),
    (["--steps", "6:5"], 2, "steps 6:5: the range is empty"),
    (["--steps", "12:"], 1, "step 12 is past the run"),
    (["--source", "1"], 2, "--source 1 numbers an index within a source: it needs --index"),
    (["--step", "3", "--index", "2"], 2, "--step and --index: give one question at a time"),
    (["--index", "-1"], 2, "index must be >= 0"),
    (["--index", "1", "--source", "2"], 2, "source must be"),
])
def test_errors_go_to_stderr_with_an_exit_code(history: Any, args: list[str], code: int, message: str) -> None:
    server, _, _, _ = history
    got, out, err = run_cli("provenance", "mix", *args, "--address", server.address)
    assert (got, out) == (code, "")
    assert message in err and "Traceback" not in err


def test_an_unknown_job_names_the_jobs_there(history: Any) -> None:
    server, _, _, _ = history
    code, out, err = run_cli("provenance", "nope", "--step", "1", "--address", server.address)
    assert (code, out) == (1, "")
    assert err == f"croupier provenance: no job 'nope' at {server.address} (jobs: mix)\n"


def test_a_coordinator_that_lost_the_history_says_which_part(history: Any, tmp_path: pathlib.Path) -> None:
    """A coordinator on a new store knows the job from the checkpoint it resumed from (step 4) on only."""
    _, _, saved, _ = history
    other = Server(f"sqlite:///{tmp_path}/new.db").start()
    try:
        generation(other.address, "mix", "c", 2, 2, dataset=SOURCES, resume=saved[4], save_at=(6,))
        code, _, err = run_cli("provenance", "mix", "--step", "2", "--address", other.address)
        assert code == 1
        assert "the history before step 5 is missing" in err and "Traceback" not in err
        code, out, _ = run_cli("provenance", "mix", "--step", "5", "--json", "--address", other.address)
        # the new store's generation, numbered apart from the lost store's 1 and 2 (croupier.server._decide.next_number)
        kept = json.loads(out)["kept"]
        assert code == 0 and kept["incarnation"] == "c" and kept["generation"] > 2
    finally:
        other.stop(grace=0.5)


def test_a_coordinator_that_does_not_answer(history: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prov, "RETRY_FOR_S", 0.5)  # the command's 3 s, shortened: the message names what it was
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out, err = run_cli("provenance", "mix", "--step", "1", "--address", f"127.0.0.1:{port}")
    assert (code, out) == (1, "")
    assert err.startswith(f"croupier provenance: the coordinator at 127.0.0.1:{port} is unavailable (retried for 0.5 s)")


def test_the_command_as_a_process_prints_no_traceback(history: Any) -> None:
    server, _, _, _ = history
    r = subprocess.run([sys.executable, "-m", "croupier.tools.cli", "provenance", "mix", "--step", "99",
                        "--address", server.address], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == ("croupier provenance: step 99 is past the run: job 'mix' has trained 7 steps (as far as its "
                        "ranks reported)\n")



def test_a_step_of_a_dataset_in_shards_names_each_samples_shard_and_row(tmp_path: pathlib.Path) -> None:
    """A shard order's steps: each sample's shard and row beside its index, as text and JSON."""
    sizes = [7, 3, 12, 5, 9, 4, 8]
    server = Server(f"sqlite:///{tmp_path}/c.db").start()
    try:
        generation(server.address, "sh", "a", 2, 3, dataset=sum(sizes), save_at=(3,), shard_sizes=sizes, shard_window=2,
                   reader_group=2)
        code, out, err = run_cli("provenance", "sh", "--step", "2", "--address", server.address)
        assert (code, err) == (0, "")
        lines = out.splitlines()
        assert lines[2].split() == ["RANK", "MICRO", "INDEX", "SHARD", "ROW", "SEED"]
        offsets = [sum(sizes[:s]) for s in range(len(sizes))]
        for line in lines[3:]:
            index, shard, row = (int(x) for x in line.split()[2:5])
            assert offsets[shard] + row == index and 0 <= row < sizes[shard]
        code, out, _ = run_cli("provenance", "sh", "--step", "2", "--json", "--address", server.address)
        doc = json.loads(out)
        for b in doc["kept"]["batches"]:
            assert [offsets[s] + r for s, r in zip(b["shards"], b["rows"], strict=True)] == b["indices"]
    finally:
        server.stop(grace=0.5)
