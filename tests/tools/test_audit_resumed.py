"""`croupier audit` follows the checkpoints' chain by the start records' fields (``resumed``), not by origin
strings; logs written before the fields existed are read by their origins."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from _ranks import on_ranks

from croupier.client import DistributedSampler
from croupier.server._service import Server
from croupier.tools.audit import audit, load
from croupier.tools.audit_log import read_records

N = 101


def _run(server: Server, logdir: pathlib.Path, world: int, incarnation: str, state: dict | None, steps: int | None,
         save_at: int | None, from_step: int | None = None) -> dict:
    """One incarnation: every rank takes `steps` indices (None: the rest of the epoch), saving at `save_at`
    (step `save_at`); it loads `state`, or the coordinator's record of `from_step`. Returns rank 0's state."""
    saved: dict = {}

    def rank(r: int) -> None:
        s = DistributedSampler(N, world, r, address=server.address, job="audited", incarnation=incarnation,
                               tail="uneven", audit_dir=str(logdir), lease_ahead=7)
        if state:
            s.load_state_dict(state)
        if from_step is not None:
            s.resume_from_step(from_step)
        for k, _ in enumerate(s, 1):
            if k == save_at:
                st = s.state_dict(step=k)
                if r == 0:
                    saved.update(st)
            if k == steps:
                break
        s.close()

    on_ranks(world, rank)
    return saved


def _starts(logdir: pathlib.Path, fn: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Rewrites every log's start record with `fn`."""
    for path in logdir.glob("*/*.audit"):
        recs = read_records(path)
        recs[0] = fn(recs[0])
        path.write_bytes(b"".join(msgpack.packb(r) for r in recs))


def _passes(logdir: pathlib.Path) -> None:
    (report,) = audit(logdir)
    assert report.ok and report.finished and (report.missing, report.duplicates, report.trained) == (0, 0, N), report


def test_the_start_record_names_the_checkpoint_resumed_from_and_the_audit_reads_it(
        server: Server, tmp_path: pathlib.Path) -> None:
    ck = _run(server, tmp_path, 2, "g1", None, steps=30, save_at=20)  # dies at 30, checkpoint at 20
    ck2 = _run(server, tmp_path, 3, "g2", ck, steps=None, save_at=5)  # resized 2 -> 3, to the end
    _run(server, tmp_path, 1, "g3", ck2, steps=None, save_at=None)  # an older checkpoint: rolls back
    incs = {i.name: i for i in load(tmp_path)["audited"]}
    assert incs["g1"].resumed is None
    assert incs["g2"].resumed == {"incarnation": "g1", "generation": incs["g1"].generation, "epoch": 0, "items": 20,
                                  "step": 20}
    assert incs["g3"].resumed == {"incarnation": "g2", "generation": incs["g2"].generation, "epoch": 0,
                                  "items": ck2["items"], "step": 5}
    _passes(tmp_path)
    # The origins are names only: the audit is the same without them (it read them before, and failed)
    _starts(tmp_path, lambda s: {**s, "origin": None if s["origin"] is None else "renamed"})
    _passes(tmp_path)
    # A log written before the fields: the audit reads the origin's parts, for it alone
    _starts(tmp_path, lambda s: {k: v for k, v in s.items() if k != "resumed"})
    with pytest.raises(ValueError, match=r"the checkpoint's origin 'renamed' is not incarnation/epoch/items"):
        audit(tmp_path)


def test_a_log_written_before_the_fields_is_followed_by_its_origins(server: Server, tmp_path: pathlib.Path) -> None:
    ck = _run(server, tmp_path, 2, "g1", None, steps=30, save_at=20)
    _run(server, tmp_path, 3, "g2", ck, steps=None, save_at=None)
    _starts(tmp_path, lambda s: {k: v for k, v in s.items() if k != "resumed"})
    _passes(tmp_path)


def test_a_resume_from_the_coordinators_record_is_followed_by_its_generation(server: Server, tmp_path: pathlib.Path) -> None:
    """A record names the generation that took it, not its incarnation: the audit finds that generation's log."""
    _run(server, tmp_path, 2, "g1", None, steps=30, save_at=20)
    _run(server, tmp_path, 3, "g2", None, steps=None, save_at=None, from_step=20)
    incs = {i.name: i for i in load(tmp_path)["audited"]}
    resumed = incs["g2"].resumed
    assert resumed is not None and (resumed["incarnation"], resumed["generation"], resumed["items"]) == (
        None, incs["g1"].generation, 20)
    _starts(tmp_path, lambda s: {**s, "origin": None if s["origin"] is None else "renamed"})
    _passes(tmp_path)
