"""`croupier skip JOB --from FILE`: the samples of provenance's steps (or a list of indices) taken out of a mixture."""

from __future__ import annotations

import json
import pathlib

import pytest
from _provenance_run import generation, run_cli

from croupier.client import CoordinatorClient
from croupier.server import Server

SOURCES = (64, 32)


def _save(server: Server, tmp_path: pathlib.Path, job: str, *question: str) -> pathlib.Path:
    code, out, err = run_cli("provenance", job, *question, "--json", "--address", server.address)
    assert code == 0, err
    path = tmp_path / f"{job}-{'-'.join(question)}.json"
    path.write_text(out)
    return path


def _skipped(server: Server, job: str) -> list[tuple[int, int]]:
    with CoordinatorClient(server.address) as c:
        return [p for a in c.status(job).amendments if a.kind == "skip" for p in a.pairs]


def _pairs(records: list[dict], sizes: tuple[int, ...]) -> set[tuple[int, int]]:
    """The (source, sample) pairs of the records' kept versions, their indices numbered by `sizes`."""
    return {(s, i - sum(sizes[:s])) for r in records if r["kept"] for b in r["kept"]["batches"]
            for i, s in zip(b["indices"], b["sources"], strict=True)}


def test_the_kept_versions_of_provenances_steps_are_skipped(server: Server, tmp_path: pathlib.Path) -> None:
    saved = generation(server.address, "mix", "a", 2, 6, dataset=SOURCES, save_at=(3, 6))
    generation(server.address, "mix", "b", 2, 2, dataset=SOURCES, resume=saved[3], save_at=(5,))
    path = _save(server, tmp_path, "mix", "--steps", "4:5")  # kept from generation 2, abandoned of generation 1
    records = json.loads(path.read_text())
    assert all(r["abandoned"] for r in records)
    code, out, err = run_cli("skip", "mix", "--from", str(path), "--address", server.address)
    assert (code, err) == (0, "")
    want = _pairs(records, SOURCES)
    assert len(want) == 16 and set(_skipped(server, "mix")) == want  # the abandoned versions' samples stay
    assert out.splitlines()[1:] == [f"  skipped: source {s}, sample {j}" for s, j in sorted(want)]
    # a file of one --step, and one of indices
    one = _save(server, tmp_path, "mix", "--step", "2")
    code, _, err = run_cli("skip", "mix", "--from", str(one), "--address", server.address)
    assert code == 0, err
    taken = set(_skipped(server, "mix"))
    assert taken == want | _pairs([json.loads(one.read_text())], SOURCES)
    free = [j for j in range(SOURCES[1]) if (1, j) not in taken][:2]
    listed = tmp_path / "listed.json"
    listed.write_text(json.dumps([SOURCES[0] + j for j in free]))  # as the ranks hand them out
    code, _, err = run_cli("skip", "mix", "--from", str(listed), "--address", server.address)
    assert code == 0, err
    assert set(_skipped(server, "mix")) == taken | {(1, j) for j in free}
    # the same again is refused, naming a sample, and records nothing
    before = _skipped(server, "mix")
    code, out, err = run_cli("skip", "mix", "--from", str(path), "--address", server.address)
    assert (code, out) == (1, "") and "is skipped already" in err
    assert _skipped(server, "mix") == before


def test_indices_a_grow_renumbered_since_are_read_as_their_generation_numbered_them(server: Server,
                                                                                     tmp_path: pathlib.Path) -> None:
    """Generation 1 dealt source 1's samples as 64 + j; source 0 grows to 80, so generation 2 deals them as 80 + j."""
    saved = generation(server.address, "mix", "a", 2, 6, dataset=SOURCES, save_at=(6,))
    path = _save(server, tmp_path, "mix", "--steps", "1:6")
    assert run_cli("amend", "mix", "--grow", "0", "80", "--address", server.address)[0] == 0
    generation(server.address, "mix", "b", 2, 1, dataset=SOURCES, resume=saved[6], save_at=(7,))
    records = json.loads(path.read_text())
    assert any(1 in b["sources"] for r in records for b in r["kept"]["batches"])
    code, _, err = run_cli("skip", "mix", "--from", str(path), "--address", server.address)
    assert code == 0, err
    assert set(_skipped(server, "mix")) == _pairs(records, SOURCES)


def test_a_mixture_of_one_source_takes_skips(server: Server, tmp_path: pathlib.Path) -> None:
    generation(server.address, "one", "a", 2, 2, dataset=(50,), save_at=(2,))
    path = _save(server, tmp_path, "one", "--step", "2")
    code, _, err = run_cli("skip", "one", "--from", str(path), "--address", server.address)
    assert code == 0, err
    from_file = _pairs([json.loads(path.read_text())], (50,))
    assert set(_skipped(server, "one")) == from_file
    free = next(j for j in range(50) if (0, j) not in from_file)
    code, out, err = run_cli("skip", "one", str(free), "--address", server.address)  # typed, as before
    assert code == 0 and out.splitlines()[1] == f"  skipped: source 0, sample {free}", err


def test_a_job_without_a_mixture_is_told_how_to_make_one(server: Server, tmp_path: pathlib.Path) -> None:
    generation(server.address, "plain", "a", 2, 2, dataset=50, save_at=(2,))
    path = _save(server, tmp_path, "plain", "--step", "1")
    code, out, err = run_cli("skip", "plain", "--from", str(path), "--address", server.address)
    assert (code, out) == (1, "")
    assert "job 'plain' deals one dataset, not a mixture of sources" in err
    assert "weights=[1.0], sources=[len(dataset)]" in err


@pytest.mark.parametrize(("text", "message"), [
    ("not json", "cannot read it as JSON"),
    ('{"a": 1}', "must hold a list of dataset indices or `croupier provenance --step/--steps --json` output"),
    ('["1", "2"]', "got a list of 2"),
    ("[]", "got a list of 0"),
    ('{"step": 3, "kept": null, "abandoned": []}', "no step in it has a kept version (steps 3)"),
    ('{"step": 3, "kept": {"generation": 1, "batches": [{"indices": [1, 2], "sources": [0]}]}, "abandoned": []}',
     "a kept version is not as `croupier provenance --json` writes it"),
    ('{"step": 3, "kept": {"generation": [1], "batches": []}, "abandoned": []}',
     "a kept version is not as `croupier provenance --json` writes it"),
])
def test_a_file_it_cannot_read_is_refused_and_records_nothing(server: Server, tmp_path: pathlib.Path, text: str,
                                                              message: str) -> None:
    generation(server.address, "mix", "a", 1, 1, dataset=SOURCES, save_at=(1,))
    path = tmp_path / "f.json"
    path.write_text(text)
    code, out, err = run_cli("skip", "mix", "--from", str(path), "--address", server.address)
    assert (code, out) == (2, "")
    assert message in err and str(path) in err
    assert _skipped(server, "mix") == []


def test_indices_and_a_file_are_one_or_the_other(server: Server, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "f.json"
    path.write_text("[1]")
    code, _, err = run_cli("skip", "mix", "3", "--from", str(path), "--address", server.address)
    assert code == 2 and "not both" in err
    code, _, err = run_cli("skip", "mix", "--address", server.address)
    assert code == 2 and "croupier skip needs the indices to skip: INDEX ... or --from FILE" in err
