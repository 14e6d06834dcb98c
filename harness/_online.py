"""The chaos run's faults that the job trains through: kills of the coordinator or of a replica (restarted on
its port), restarts of the database, and the data-center faults of :mod:`croupier.harness._faults` (one
coordinator) and :mod:`croupier.harness._dc_replicas` (replicas).

:class:`OnlineFaults` is the part of :class:`croupier.harness.chaos.Run` that injects them (the launch's own
kills and preemptions are the run's); it uses the run's servers, tally, random choices and log.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from croupier.demos.cluster import runs_trainer
from croupier.harness import _dc_replicas, _faults, history
from croupier.harness.history import ChaosError
from croupier.tools.serve import ServeGroup, active_clients

if TYPE_CHECKING:
    import random


class DatabaseControl(Protocol):
    """What the replicated mode needs to restart the PostgreSQL server under the replicas."""

    def restart(self, mode: str) -> None:
        """Stops the server with shutdown mode `mode` ("fast" or "immediate") and starts it again on
        the same address; MUST return only once it accepts connections again."""
        ...


def where(statuses: list[dict[str, Any]]) -> str:
    """Where the furthest rank is, from its status file."""
    if not statuses:
        return "an unknown step"
    s = max(statuses, key=lambda s: (s["epoch"], s["step"]))
    return f"epoch {s['epoch']} step {s['step']}"


class OnlineFaults:
    """Injects the faults a launch trains through (see the module)."""

    servers: ServeGroup
    tally: history.Tally
    rng: random.Random
    database: DatabaseControl | None
    datacenter: _faults.Faults | None
    restart_s: float
    faults: int
    time_left: float

    def _online_fault(self, kind: str, st: list[dict[str, Any]]) -> None:
        """A fault the job trains through: kill -9 of the coordinator or of a replica (restarted on its
        port), or a restart of the database."""
        at = where(st)
        members = self.servers.members
        if isinstance(self.datacenter, _dc_replicas.ReplicatedDatacenter) and kind in _dc_replicas.KINDS:
            said = self.datacenter.inject(kind, self.servers, self.tally, self.time_left, st, at)
            if said is not None:
                self._say(said)
            return
        if kind in _faults.KINDS:
            self._datacenter_fault(kind, st, at)
            return
        if kind == "coordinator":
            members[0].kill()
            self.tally.coordinator_kills += 1
            took = self._restart(members[0].start)
            self._say(f"SIGKILL of the coordinator at {at}; restarted on port {members[0].port} in {took:.1f} s, "
                      "the ranks carry on")
            return
        if kind == "replica":
            # Both drawn every time so that a seed replays the same choices whatever the traffic.
            busiest, other = self.rng.random() < 0.5, self.rng.randrange(len(members))
            active = [active_clients(m.port, prefix=m.prefix) for m in members]
            if self.tally.replica_kills == 0:
                i, why = 0, "the first endpoint, every rank's first choice"
            elif busiest and max(active) > 0:
                i, why = active.index(max(active)), "the one the ranks are using"
            else:
                i, why = other, "at random"
            victim = members[i]
            victim.kill()
            self.tally.replica_kills += 1
            self.tally.first_endpoint_kills += i == 0
            self.tally.busy_replica_kills += active[i] > 0
            took = self._restart(victim.start)
            self._say(f"SIGKILL of replica {i} at {victim.address} ({why}; {active[i]} client connections active, "
                      f"{sum(active)} in all) at {at}; restarted in {took:.1f} s, the ranks carry on")
            return
        database = self.database
        if database is None:
            raise ChaosError("a database fault without a database control")  # not drawn without one
        modes = self.tally.database_restarts
        mode = history.DATABASE_MODES[sum(modes.values()) % len(history.DATABASE_MODES)]
        try:
            took = self._restart(lambda: database.restart(mode))
        except Exception as e:  # the control's own failure is not one of croupier's
            raise ChaosError(f"the database did not restart (shutdown mode {mode}): {type(e).__name__}: {e}") from e
        modes[mode] += 1
        self.servers.check()  # every replica outlives the outage
        self._say(f"restart of PostgreSQL ({mode} shutdown) at {at}, back in {took:.1f} s; the replicas lost "
                  "their database meanwhile, the ranks carry on")

    def _datacenter_fault(self, kind: str, st: list[dict[str, Any]], at: str) -> None:
        """A pause of the coordinator or of a worker, a jump of the coordinator's clock, its disk full, or the
        network between it and the job cut or slow."""
        f, t, coordinator = self.datacenter, self.tally, self.servers.members[0]
        assert f is not None and coordinator.proc is not None
        # The job trains through a paused coordinator or a full disk: such a fault ends while the job
        # still runs, so that the faults still due find it running.
        within = max(0.2, self.time_left / 2)
        if kind == "pause":
            took = f.pause(coordinator.proc.pid, within)
            t.coordinator_pauses += 1
            self._say(f"the coordinator stopped (SIGSTOP) for {took:.1f} s at {at}, then woken; the ranks carry on")
        elif kind == "rank-pause":
            live = [s for s in st if not s.get("done") and runs_trainer(s["pid"])]
            if not live:
                return  # the launch is ending: nothing to pause, the fault comes again
            victim = live[self.rng.randrange(len(live))]
            took = f.pause(victim["pid"], within)
            t.rank_pauses += 1
            self._say(f"rank {victim['rank']} stopped (SIGSTOP) for {took:.1f} s at {at}, then woken")
        elif kind == "clock":
            offset = f.jump()
            t.clock_jumps += 1
            self._say(f"the coordinator's wall clock set to {offset} at {at}")
        elif kind == "disk":
            took = f.fill(within)
            t.disk_fulls += 1
            self._say(f"the coordinator's store's file system full for {took:.1f} s at {at}, then freed")
        elif kind == "partition":
            took = f.partition(within)
            t.partitions += 1
            self._say(f"the job's network cut from the coordinator's for {took:.1f} s at {at}, then healed")
        else:
            took, passed, dropped = f.slow_link(within)
            t.slow_links += 1
            self._say(f"the link between the job and the coordinator {_faults.SLOW_DELAY_MS:.0f} ms slow each way, "
                      f"{_faults.SLOW_LOSS:.0%} of its packets lost, for {took:.1f} s at {at} ({passed} packets "
                      f"passed, {dropped} dropped)")
        self.servers.check()  # the coordinator outlives each of them

    def _restart(self, start: Callable[[], object]) -> float:
        """Runs `start`, a restart the ranks train through; returns its seconds (the longest so far is kept)."""
        t = time.monotonic()
        start()
        took = time.monotonic() - t
        self.restart_s = max(self.restart_s, took)
        return took

    def _say(self, what: str) -> None:
        print(f"\n  ! fault {self.tally.faults}/{self.faults}: {what}", flush=True)

    # ---------------------------------------------------------------- the run

