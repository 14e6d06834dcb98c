"""kill -9 of the coordinator under load: acknowledged joins survive, and the jobs stay exactly-once."""

from __future__ import annotations

import json
import os
import pathlib
import queue
import random
import subprocess
import sys
import threading

import pytest
from conftest import ServeProcess

from croupier.client._rpc import CoordinatorClient

pytestmark = pytest.mark.e2e  # several processes

HERE = pathlib.Path(__file__).resolve().parents[1]


def crash_run(tmp_path: pathlib.Path, serve_process: type[ServeProcess], kills: int, workers: int, epochs: int,
              seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    store = f"sqlite:///{tmp_path}/coordinator.db"
    server = serve_process(store)
    procs = [
        subprocess.Popen([sys.executable, str(HERE / "_crash_worker.py"), server.address, f"job{i}", str(seed * 100 + i), str(epochs)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(workers)
    ]
    lines: queue.Queue[tuple[int, str | None]] = queue.Queue()

    def pump(i: int, p: subprocess.Popen[str]) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            lines.put((i, line))
        lines.put((i, None))

    for i, p in enumerate(procs):
        threading.Thread(target=pump, args=(i, p), daemon=True).start()

    acked: dict[tuple[str, str, int], int] = {}  # (job, incarnation, rank) -> generation acknowledged
    done: dict[int, dict] = {}
    open_streams = len(procs)
    kills_done = 0
    until_kill = rng.randint(1, 40)
    try:
        while open_streams:
            i, line = lines.get(timeout=300)
            if line is None:
                open_streams -= 1
                continue
            msg = json.loads(line)
            if "ack" in msg:
                acked[(msg["job"], msg["incarnation"], msg["rank"])] = msg["generation"]
            elif "done" in msg:
                done[i] = msg
            until_kill -= 1
            if until_kill == 0 and kills_done < kills:
                # kill -9 at a moment chosen by the load itself, then restart on the same store and port.
                server.kill()
                kills_done += 1
                server = serve_process(store, port=server.port)
                with CoordinatorClient(server.address, retry_for=30) as c:
                    for (job, _token, rank), gen in acked.items():
                        _, now = c.get_job(job)
                        assert now.generation >= gen, f"acknowledged join of {job} rank {rank} to generation {gen} was lost"
                        if now.generation == gen:
                            assert rank not in now.waiting_for, f"acknowledged join of {job} rank {rank} was lost"
                until_kill = rng.randint(1, 40)
        for p in procs:
            assert p.wait(timeout=60) == 0, p.stderr.read() if p.stderr else ""
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert kills_done == kills, f"only {kills_done} kills: the load ended first"
    audited = rpcs = 0
    for i, msg in done.items():
        for epoch, trained in msg["epochs"].items():
            assert sorted(trained) == list(range(msg["n"])), f"job{i} epoch {epoch}: duplicates or missing indices"
            audited += len(trained)
        rpcs += msg["rpcs"]
    assert len(done) == workers
    return {"kills": kills_done, "acked_joins": len(acked), "rpcs": rpcs, "indices_audited": audited}


def test_kill_minus_nine_under_load(tmp_path: pathlib.Path, serve_process: type[ServeProcess]) -> None:
    stats = crash_run(tmp_path, serve_process, kills=12, workers=2, epochs=3, seed=1)
    print(f"\ncrash test: {stats}")


@pytest.mark.slow
def test_kill_minus_nine_long(tmp_path: pathlib.Path, serve_process: type[ServeProcess]) -> None:
    stats = crash_run(tmp_path, serve_process, kills=int(os.environ.get("CROUPIER_KILLS", "200")), workers=3, epochs=40, seed=2)
    print(f"\ncrash test: {stats}")
