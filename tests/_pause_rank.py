"""A rank for tests/e2e/test_pauses.py: joins a job (world 1, an incarnation of its own) through one coordinator, then asks
grants and reports checkpoints of its generation until it is fenced, recording every call (harness/linearize.py).

    python tests/_pause_rank.py ADDRESS JOB HISTORY NAME
"""

from __future__ import annotations

import sys
import time

import grpc

from croupier.core.cursor import Cursor
from croupier.core.spec import Spec
from croupier.core.wire import checkpoint_to_proto, spec_to_proto
from croupier.harness.linearize import Recorder
from croupier.v1 import coordinator_pb2 as pb
from croupier.v1 import coordinator_pb2_grpc as pb_grpc

SPEC = Spec(n=100_000, batch_size=10)


def main() -> int:
    address, job, history, name = sys.argv[1:5]
    rec = Recorder(history, name)
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        with rec.call(job, "join") as out:
            r = stub.Join(pb.JoinRequest(request_id=f"{name}-join", job=job, spec=spec_to_proto(SPEC), incarnation=name, world=1,
                                         rank=0), timeout=30)
            out["generation"] = g = r.generation
        print(f"JOINED {g}", flush=True)
        for step in range(1, 20_000):
            kind = "checkpoint" if step % 5 == 0 else "grant"
            try:
                with rec.call(job, kind, g) as out:
                    try:
                        if kind == "grant":
                            stub.Grant(pb.GrantRequest(job=job, generation=g, rank=0, epoch=0, first_batch=step, count=1,
                                                       progress=pb.Progress(epoch=0, batches=step)), timeout=60)
                        else:
                            stub.Report(pb.ReportRequest(
                                job=job, generation=g, rank=0, progress=pb.Progress(epoch=0, batches=step),
                                checkpoint=checkpoint_to_proto(step, Cursor(0, ((step * 10, SPEC.n),)), f"{name}/{step}")),
                                timeout=60)
                    except grpc.RpcError as e:
                        if e.code() == grpc.StatusCode.ABORTED:
                            out["outcome"] = "fenced"
                        raise
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.ABORTED:
                    print(f"FENCED at step {step} ({kind})", flush=True)
                    return 0
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
            time.sleep(0.02)  # a training step's pace, not synchronisation
    print("never fenced", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
