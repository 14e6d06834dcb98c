"""The processes of tests/e2e/test_partitions.py that run inside a network namespace.

    python tests/_partition_agents.py rank ADDRESSES AUDIT_DIR STOP_FILE
        A training rank: a DistributedSampler (world 1) over every replica, batches paced at 5 ms, a
        checkpoint every 100 batches, epoch after epoch until STOP_FILE exists (the epoch in progress is
        finished); prints "EPOCH e" as each ends.
    python tests/_partition_agents.py probe HISTORY
        Calls on command: one JSON line per call on stdin ({"op": "join" | "grant", "addr", "job",
        "incarnation" | "generation", and "timeout" in seconds if not CALL_S}), each recorded (croupier.harness.linearize) and answered on stdout with its
        status code, its seconds and, for a join, its generation. Batches, each answered with the lists
        "codes" and "seconds" of its calls: {"op": "grants", "count", ...} (grants one after the other),
        {"op": "depart", "jobs", "timeout", ...} (a join of each job at once), {"op": "writes", "incarnation",
        ...} (joins opening generation after generation in a thread, incarnations "incarnation0", "...1", ...,
        answered at once) and {"op": "settle"} (ends the writes after the join in flight, answered with them).
"""

from __future__ import annotations

import json
import pathlib
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from croupier.core.spec import Spec
from croupier.core.wire import spec_to_proto
from croupier.harness.linearize import Recorder
from croupier.v1 import coordinator_pb2 as pb
from croupier.v1 import coordinator_pb2_grpc as pb_grpc

N = 2000
CALL_S = 3.0  # a call across a cut gets no answer: it ends at this deadline
#: A probe's channel tries to connect again within a second of a failure (gRPC's default backoff grows to 2 min).
FAST = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000)]


def rank(addresses: str, audit: str, stop: str) -> int:
    from croupier.client import DistributedBatchSampler

    s = DistributedBatchSampler(N, batch_size=10, num_replicas=1, rank=0, address=addresses, job="train", incarnation="t1",
                                audit_dir=audit, lease_ahead=20)
    try:
        epoch = 0
        while True:
            s.set_epoch(epoch)
            for k, _ in enumerate(s, 1):
                time.sleep(0.005)  # a training step's pace, not synchronisation
                if k % 100 == 0:
                    s.state_dict()
            print(f"EPOCH {epoch}", flush=True)
            epoch += 1
            if pathlib.Path(stop).exists():
                return 0
    finally:
        s.close()


def probe(history: str) -> int:
    rec = Recorder(history, "probe")
    spec = spec_to_proto(Spec(n=1000, batch_size=10))
    channels: dict[str, grpc.Channel] = {}
    writer: dict[str, Any] = {}

    def one(cmd: dict[str, Any]) -> dict[str, Any]:
        """One call, recorded: its status code, its seconds and, for a join, its generation."""
        ch = channels.get(cmd["addr"]) or channels.setdefault(cmd["addr"], grpc.insecure_channel(cmd["addr"], options=FAST))
        stub = pb_grpc.CoordinatorStub(ch)
        answer: dict[str, Any] = {"code": "OK"}
        t0 = time.monotonic()
        kind = "join" if cmd["op"] == "join" else "grant"
        try:
            with rec.call(cmd["job"], kind, cmd.get("generation", 0)) as out:
                try:
                    if kind == "join":
                        r = stub.Join(pb.JoinRequest(request_id=cmd["incarnation"], job=cmd["job"], spec=spec, incarnation=cmd["incarnation"],
                                                     world=1, rank=0), timeout=cmd.get("timeout", CALL_S),
                                                     wait_for_ready=True)
                        out["generation"] = answer["generation"] = r.generation
                    else:
                        stub.Grant(pb.GrantRequest(job=cmd["job"], generation=cmd["generation"], rank=0, epoch=0,
                                                   first_batch=0, count=1), timeout=cmd.get("timeout", CALL_S),
                                   wait_for_ready=True)
                except grpc.RpcError as e:
                    answer["seconds"] = time.monotonic() - t0
                    answer["code"] = e.code().name
                    if e.code() == grpc.StatusCode.ABORTED:
                        out["outcome"] = "fenced"
                    raise
                answer["seconds"] = time.monotonic() - t0  # the call's own time, not the record's
        except grpc.RpcError:
            pass
        return answer

    def batch(answers: list[dict[str, Any]]) -> dict[str, Any]:
        return {"codes": [a["code"] for a in answers], "seconds": [a["seconds"] for a in answers]}

    def writes(cmd: dict[str, Any], stop: threading.Event, done: list[dict[str, Any]]) -> None:
        while not stop.is_set():
            done.append(one({**cmd, "op": "join", "incarnation": f"{cmd['incarnation']}{len(done)}"}))

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "grants":  # `count` grants, one after the other
            out = batch([one({**cmd, "op": "grant"}) for _ in range(cmd["count"])])
        elif cmd["op"] == "depart":  # a join of each of `jobs` at once, each with `timeout`
            joins = [{**cmd, "op": "join", "job": job, "incarnation": job} for job in cmd["jobs"]]
            with ThreadPoolExecutor(len(joins)) as pool:
                out = batch(list(pool.map(one, joins)))
        elif cmd["op"] == "writes":  # joins opening generation after generation, in a thread, until "settle"
            writer.update(stop=threading.Event(), done=[])
            writer["thread"] = threading.Thread(target=writes, args=(cmd, writer["stop"], writer["done"]))
            writer["thread"].start()
            out = {"code": "OK"}
        elif cmd["op"] == "settle":  # the writes end with the join in flight
            writer["stop"].set()
            writer["thread"].join()
            out = batch(writer["done"])
        else:
            out = one(cmd)
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    what = sys.argv[1]
    sys.exit(rank(*sys.argv[2:5]) if what == "rank" else probe(sys.argv[2]))
