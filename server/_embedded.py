"""The embedded coordinator's process: a coordinator that a training process starts for its job, in a
process of its own (``python -m croupier.server._embedded``; see ``croupier.client._embedded``).

The protocol with the parent, over the child's standard streams:

- stdin, first line: a JSON object ``{"store": URL, "host": HOST, "name": NAME, "secret": SECRET | null}``.
- stdout, one line: ``listening on HOST:PORT``, or ``held <message>`` when the store is still held by another
  coordinator (the previous one of a process that was killed, still closing it: the parent tries again), or
  ``failed <message>`` for anything else. Nothing is written to stdout after that line.
- stdin, after the first line: nothing. Its end (the parent closed it, exited, or was killed: the kernel closes
  a dead process's descriptors) stops the coordinator, which lets calls in flight finish within half a second.

NOTE: the coordinator lives in a process of its own so that the training process has no thread inside gRPC
while its ``DataLoader`` forks workers: a server's threads are always inside gRPC, and gRPC then skips its fork
handlers (and logs so at every fork). It ignores SIGINT: a Ctrl-C in the terminal goes to the whole foreground
group, and the trainer may still want to checkpoint through its coordinator when it catches it.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from croupier.server._auth import Authorizer
from croupier.server._service import Server
from croupier.server._store import StoreUnavailable

#: How long the calls in flight may take to finish once the parent is gone.
GRACE_S = 0.5


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conf = json.loads(sys.stdin.readline())
    secret = conf.get("secret")
    try:
        auth = Authorizer.of_secret(str(conf["name"]), str(secret)) if secret else None
        server = Server(str(conf["store"]), host=str(conf["host"]), port=0, auth=auth).start()
    except StoreUnavailable as e:
        print(f"{'held' if 'second coordinator' in str(e) else 'failed'} {e}", flush=True)
        return 1
    except Exception as e:  # reported to the parent, which raises it in the trainer
        print(f"failed {type(e).__name__}: {e}", flush=True)
        return 1
    print(f"listening on {server.address}", flush=True)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (the parent reads one line: nothing more may go there)
    try:
        while sys.stdin.read(1 << 16):  # until the parent is gone
            pass
    finally:
        server.stop(GRACE_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
