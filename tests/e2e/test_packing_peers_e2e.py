"""The peers' packing + filtering failure beside croupier's, as processes: 2 ranks x 4 workers killed (-9) mid-epoch,
resumed by 3 ranks x 2 workers; croupier's audit is exact, the baseline's losses and repeats are printed.

croupier: `PackedLoader` over a dataset that rejects some documents (``Filtered``), checkpointing every 2
steps on a ``croupier serve`` coordinator (tests/_packing_rank.py). The baseline: torchdata's
``StatefulDataLoader`` over a packing ``IterableDataset`` that filters and packs in its workers, as people
write it (tests/_peer_rank.py): its state counts a document consumed once it is in the worker's buffer;
its state cannot be loaded on another world or worker count, so the resumed ranks start the global order
after the documents every old worker counted consumed. Its losses and repeats are counted, not asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from _filter_data import kept_lengths
from _packing_data import token_audit

from croupier.tools.audit import audit, render, verdict

pytestmark = pytest.mark.e2e  # several processes

TESTS = Path(__file__).resolve().parents[1]


def _lengths(n: int) -> list[int]:
    return [(i * 37) % 45 + 1 for i in range(n)]


def _procs(argvs: list[list[str]]) -> list[int]:
    procs = [subprocess.Popen([sys.executable, *argv], cwd=TESTS) for argv in argvs]
    return [p.wait(timeout=300) for p in procs]


def _rows(run: Path, world: int) -> list[dict]:
    return [json.loads(line) for r in range(world) for line in (run / f"{r}.jsonl").read_text().splitlines()]


def _croupier(address: str, tmp: Path, lengths: list[int], reject: list[int]) -> tuple[dict, str]:
    job, logs = uuid.uuid4().hex, tmp / "audit"

    def world(w: int, run: Path, *extra: str) -> list[int]:
        run.mkdir(parents=True)
        return _procs([[str(TESTS / "_packing_rank.py"), address, job, str(r), str(w), str(run / "init"),
                        str(run / f"{r}.jsonl"), json.dumps(lengths), "--reject", json.dumps(reject),
                        "--audit", str(logs), *extra] for r in range(w)])

    assert world(2, tmp / "a", "--every", "2", "--kill-after", "5", "--workers", "4") == [-9, -9]
    saved = json.loads((tmp / "a" / "0.jsonl.state").read_text())
    kept = [tuple(p) for x in _rows(tmp / "a", 2) if x["step"] <= saved["step"] for p in x["pieces"]]
    (tmp / "state.json").write_text(json.dumps(saved))
    assert world(3, tmp / "b", "--state", str(tmp / "state.json"), "--workers", "2") == [0, 0, 0]
    rest = [tuple(p) for x in _rows(tmp / "b", 3) if "pieces" in x for p in x["pieces"]]
    bad = token_audit(kept_lengths(lengths, reject), kept + rest, None)
    reports = audit(logs)
    table = render(reports)
    assert not bad, bad
    assert verdict(reports)[0], table
    assert [(r.filtered, r.missing, r.duplicates) for r in reports] == [(len(reject), 0, 0)], table
    return bad, table


def _baseline(tmp: Path, lengths: list[int], reject: list[int]) -> dict:
    def world(w: int, run: Path, *extra: str) -> list[int]:
        run.mkdir(parents=True)
        return _procs([[str(TESTS / "_peer_rank.py"), str(r), str(w), str(run / f"{r}.jsonl"), json.dumps(lengths),
                        json.dumps(reject), str(run / "states"), *extra] for r in range(w)])

    codes = world(2, tmp / "pa", "--every", "2", "--kill-after", "5", "--workers", "4")
    assert codes == [-9, -9], codes
    kept = [tuple(p) for x in _rows(tmp / "pa", 2) if x["step"] <= 4 for p in x["pieces"]]
    assert world(3, tmp / "pb", "--resume-from", str(tmp / "pa" / "states"), "--workers", "2") == [0, 0, 0]
    rest = [tuple(p) for x in _rows(tmp / "pb", 3) for p in x["pieces"]]
    return dict(token_audit(kept_lengths(lengths, reject), kept + rest, None))


def _run(serve_process, tmp: Path, n: int) -> None:  # type: ignore[no-untyped-def]
    lengths = _lengths(n)
    reject = [i for i in range(n) if i % 9 == 4]
    server = serve_process(f"sqlite:///{tmp}/c.db")
    ours, table = _croupier(server.address, tmp / "croupier", lengths, reject)
    peer = _baseline(tmp / "peer", lengths, reject)
    print(f"\n{n} documents ({len(reject)} filtered), 2 ranks x 4 workers killed after step 5 (checkpoint at 4), "
          "resumed by 3 ranks x 2 workers; tokens:")
    print("| pipeline | missing | repeated |\n|---|---|---|")
    print(f"| croupier PackedLoader | {ours.get('missing', 0)} | {ours.get('repeated', 0)} |")
    print(f"| StatefulDataLoader + packing IterableDataset | {peer.get('missing', 0)} | {peer.get('repeated', 0)} |")
    print(table)


def test_packing_and_filtering_killed_and_resumed_on_another_world_beside_the_peers(  # type: ignore[no-untyped-def]
        serve_process, tmp_path: Path) -> None:
    _run(serve_process, tmp_path, 90)


@pytest.mark.slow
def test_the_same_on_a_bigger_corpus(serve_process, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _run(serve_process, tmp_path, 600)
