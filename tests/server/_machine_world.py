"""The state machine's setups and worlds: what a drawn job is, and its ranks' real samplers."""

from __future__ import annotations

import collections
import dataclasses
import os
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
from _ranks import Ranks
from _sim import allowance
from hypothesis import strategies as st

from croupier.client import DistributedBatchSampler, DistributedSampler
from croupier.core.spec import Spec
from croupier.server import Server, Store, StoreUnavailable
from croupier.server._store import Recovered


def _decisions(server: Server) -> Any:
    """The coordinator's state without the live ranks' progress and deals, which their prefetch
    threads report and ask for in the background (so they may change while a zombie is refused),
    and without the ledger's record of them (each segment's reports and deals)."""
    state = msgpack.unpackb(server.core.snapshot_state())
    for job in state["jobs"]:
        job.pop("progress", None)
        job.pop("deals", None)
        for seg in job.get("ledger", []):
            seg.pop("reached", None)
            seg.pop("deals", None)
    return state

JOB = "job"
MAX_WORLD = 8
#: Replaced generations whose samplers stay open as zombies; older ones are closed (their tokens stay known).
ZOMBIE_GENERATIONS = 2
# The default takes about a minute on two cores; CROUPIER_SM_EXAMPLES changes it; `make slow` runs the long test.
EXAMPLES = int(os.environ.get("CROUPIER_SM_EXAMPLES", "100"))
STEPS = int(os.environ.get("CROUPIER_SM_STEPS", "30"))

#: What the runs of this process did, printed at the end (pytest -s) for the record.
TOTALS: collections.Counter[str] = collections.Counter()

Sampler = DistributedSampler | DistributedBatchSampler


class _Handle:
    """One coordinator process's handle on a store that outlives the process, as a disk outlives kill -9.

    ``Server.stop`` closes the store its coordinator owns; closing a handle leaves the store
    open for the next coordinator, and a call through a closed handle fails as one to a closed
    store does.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.url = store.url
        self.shared = store.shared
        self._closed = False

    def _open(self) -> Store:
        if self._closed:
            raise StoreUnavailable(f"store {self.url} is closed")
        return self.store

    def append(self, records: Sequence[bytes]) -> int:
        return self._open().append(records)

    def write_snapshot(self, seq: int, payload: bytes) -> None:
        self._open().write_snapshot(seq, payload)

    def load(self) -> Recovered:
        return self._open().load()

    def close(self) -> None:
        self._closed = True


@dataclasses.dataclass(frozen=True)
class Setup:
    """An example's job: which sampler class every rank makes, and with which arguments.

    For ``DistributedSampler`` (``kind="index"``) ``batch`` is the training loop's batch size
    (a DataLoader's: each step takes that many indices); for ``DistributedBatchSampler``
    (``kind="batch"``) it is the sampler's own, and a step takes one batch.
    """

    kind: str
    n: int
    seed: int
    permutation: str
    partition: str
    tail: str
    buffer_size: int | None
    batch: int
    drop_last: bool  # the batch sampler's: drop a rank's last incomplete batch
    even_batches: bool  # the batch sampler's
    lease_ahead: int
    prefetch: int
    lengths: tuple[int, ...] = ()  # token-budget batches: each sample's length
    max_tokens: int = 0
    token_window: int = 0
    sources: tuple[int, ...] = ()  # a mixture: each source's size (n is then an epoch's length)
    weights: tuple[tuple[int, tuple[int, ...]], ...] = ()  # its schedule: (from sample, weights)
    max_epochs: tuple[int | None, ...] = ()
    shard_sizes: tuple[int, ...] = ()  # a shard order: each shard's size (they add up to n)
    shard_window: int = 32
    lanes: int = 16
    reader_group: int = 1

    def _mixture(self) -> dict[str, Any]:
        if not self.sources:
            return {}
        return dict(sources=list(self.sources), weights=[(a, list(w)) for a, w in self.weights],
                    max_epochs=list(self.max_epochs) or None)

    def sampler(self, address: str, incarnation: str, world: int, rank: int) -> Sampler:
        common: dict[str, Any] = dict(
            num_replicas=world, rank=rank, shuffle=self.permutation != "none", seed=self.seed, address=address,
            job=JOB, permutation=self.permutation, partition=self.partition, tail=self.tail,
            buffer_size=self.buffer_size, incarnation=incarnation, lease_ahead=self.lease_ahead, prefetch=self.prefetch,
            **self._mixture(),
        )
        if self.shard_sizes:
            common.update(shard_sizes=list(self.shard_sizes), shard_window=self.shard_window, lanes=self.lanes,
                          reader_group=self.reader_group)
        if self.kind == "index":  # a step takes `batch` indices of every rank: the trainer's global batch
            return DistributedSampler(self.n, global_batch=self.batch * world, **common)
        if self.kind in DEALT:
            return DistributedBatchSampler(self.n, self.batch, dealing=DEALINGS.get(self.kind, self.kind), **common)
        if self.kind in TOKENS:
            return DistributedBatchSampler(self.n, lengths=list(self.lengths), max_tokens=self.max_tokens,
                                           token_window=self.token_window, **common)
        if self.kind == "shards":
            return DistributedBatchSampler(self.n, self.batch, **common)
        return DistributedBatchSampler(self.n, self.batch, drop_last=self.drop_last, even_batches=self.even_batches,
                                       **common)

    def allowance(self, final: int, worlds: list[int]) -> tuple[int, int]:
        """(missing, repeats) G1 allows an epoch completed by `final` ranks, `worlds` having trained in it."""
        if self.kind in ("index", *TOKENS):  # spec batch_size 1: nothing dropped by batching
            return allowance(self.tail, self.partition, final, worlds)
        return allowance(self.tail, self.partition, final, worlds, self.batch, self.drop_last, self.even_batches)

    @property
    def grows(self) -> bool:
        """Whether a source of its mixture may grow (not with token budgets' lengths or a shard order's sizes)."""
        return self.kind not in (*TOKENS, *SHARDED)

    @property
    def spec(self) -> Spec:
        """What the audit needs of the spec (n; a mixture's stream)."""
        if not self.sources:
            return Spec(n=self.n, tail=self.tail, partition=self.partition)
        from croupier.client._shards import mixture_fields

        if self.shard_sizes:  # each source in its shard order
            return Spec.with_shards(self.shard_sizes, n=self.n, tail=self.tail, seed=self.seed, shard_window=self.shard_window,
                                    lanes=self.lanes, reader_group=self.reader_group, **mixture_fields(None, **self._mixture()))
        return Spec(n=self.n, tail=self.tail, partition=self.partition, seed=self.seed, permutation=self.permutation,
                    **mixture_fields(None, **self._mixture()))


#: The kinds of job the state machine draws. Jobs of generations: the index sampler, the batch sampler, and the
#: batch sampler with dynamic dealing (ranks step together; a checkpoint is rank 0's) or the toy way of dealing
#: that a test registers (tests/_reverse_kind.py: the coordinator deals full batches from the back), and with
#: token-budget batches (a step takes one batch of varying size); "mixture" makes a third of them (all, alone)
#: deal a weighted mixture of sources whose weights change and whose sources may be capped. Jobs of
#: torchft-style replica-group steps (STEPPED): over the order's positions, or the toy's stepped variant.
KINDS = os.environ.get("CROUPIER_SM_KINDS", "index,batch,dynamic,reverse,tokens,shards,shards-tokens,shards-dynamic,"
                       "mixture,steps,reverse-steps").split(",")
#: The kinds of job of replica-group steps (tests/server/_machine_ft.py), each with its spec's ``dealing``.
STEPPED = {"steps": "static", "reverse-steps": "reverse"}
#: The kinds the coordinator deals, each its own spec's ``dealing`` ("reverse" while tests/_reverse_kind.py
#: registers it) unless DEALINGS names it ("shards-dynamic": a shard order dealt dynamically).
DEALT = ("dynamic", "reverse", "shards-dynamic")
DEALINGS = {"shards-dynamic": "dynamic"}
#: The kinds with token-budget batches (a shard order's with "shards-tokens").
TOKENS = ("tokens", "shards-tokens")
#: The kinds with a shard order (of each source, in a mixture).
SHARDED = ("shards", "shards-tokens", "shards-dynamic")


@st.composite
def setups(draw: st.DrawFn) -> Setup:
    """A job: either sampler class, any spec of up to 60 samples, and a few small leases kept ahead."""
    # "mixture" in KINDS: a third of the jobs (all of them when it is alone) deal a mixture of sources
    kind = draw(st.sampled_from([k for k in KINDS if k != "mixture" and k not in STEPPED]
                                or ["index", "batch", *DEALT, *TOKENS, *SHARDED]))
    partition = draw(st.sampled_from(["strided", "chunked", "contiguous"]))
    tail = draw(st.sampled_from(["pad", "drop", "uneven", "pad_last"]))
    if kind in DEALT:  # no stripes, no padding: whoever asks gets the next batch
        partition, tail = "strided", "uneven"
    token: dict[str, Any] = {}
    if kind in TOKENS:  # whole batches dealt round-robin; a tail re-cuts the last round
        partition, tail = "strided", draw(st.sampled_from(["pad", "drop", "uneven"]))
        budget = draw(st.integers(1, 12))
        token = dict(max_tokens=budget, token_window=draw(st.integers(1, 16)))
    drop_last = even = False
    if kind == "batch":
        drop_last = draw(st.booleans())
        # NOTE: chunked parts with an uneven tail can differ by far more than one position (a
        # rank may get none), so even_batches could drop almost anything: _sim.allowance has no
        # honest bound for it, and that combination is left out.
        even = draw(st.booleans()) if (partition, tail) != ("chunked", "uneven") else False
    n = draw(st.integers(1, 60))
    mixed = "mixture" in KINDS and ([k for k in KINDS if k not in STEPPED] == ["mixture"]
                                    or draw(st.integers(0, 2)) == 0)
    mixture = draw(mixtures()) if mixed else {}
    space = sum(mixture["sources"]) if mixture else n
    sharded: dict[str, Any] = {}
    if kind in SHARDED:  # a shard order (of each source, in a mixture): reader groups of any size, a few windows and heads
        partition = "strided"
        sizes: list[int] = []
        for size in mixture["sources"] if mixture else [n]:
            cuts = sorted(set(draw(st.lists(st.integers(1, size - 1), max_size=6)))) if size > 1 else []
            sizes += [b - a for a, b in zip([0, *cuts], [*cuts, size])]
        sharded = dict(shard_sizes=tuple(sizes), shard_window=draw(st.integers(1, 4)), lanes=draw(st.integers(1, 6)),
                       reader_group=draw(st.integers(1, 3)))
    if token:
        token["lengths"] = tuple(draw(st.lists(st.integers(1, token["max_tokens"]), min_size=space, max_size=space)))
    permutations = ["shards"] if sharded else ["none", "feistel"] if mixture else ["none", "feistel", "torch", "window"]
    return Setup(
        kind=kind, n=n, seed=draw(st.integers(0, 2**32)),
        permutation=draw(st.sampled_from(permutations)), partition=partition, tail=tail,
        buffer_size=None if sharded else draw(st.one_of(st.none(), st.integers(1, 20))), batch=draw(st.integers(1, 4)),
        drop_last=drop_last, even_batches=even, lease_ahead=draw(st.integers(1, 3)), prefetch=draw(st.integers(2, 3)),
        **token, **mixture, **sharded,
    )


@st.composite
def mixtures(draw: st.DrawFn) -> dict[str, Any]:
    """A mixture of 2 or 3 small sources, its weights changed once or not, a source capped or not."""
    from croupier.client._shards import mixture_fields
    from croupier.core.stream import Stream

    k = draw(st.integers(2, 3))
    sources = tuple(draw(st.lists(st.integers(1, 15), min_size=k, max_size=k)))
    weights = st.lists(st.integers(0, 5), min_size=k, max_size=k).filter(any).map(tuple)
    schedule = [(0, draw(weights))]
    if draw(st.booleans()):
        schedule.append((draw(st.integers(1, 150)), draw(weights)))
    caps = tuple(draw(st.lists(st.sampled_from([None, None, 1, 2]), min_size=k, max_size=k)))
    try:  # a schedule and caps that leave nothing to deal somewhere are refused: then no caps
        fields = mixture_fields(None, [(a, list(w)) for a, w in schedule], list(sources), list(caps))
        Stream(fields["sources"], fields["weights"], fields["max_epochs"])
    except ValueError:
        caps = ()
    return dict(sources=sources, weights=tuple(schedule), max_epochs=caps)


class World:
    """One generation of the job as its ranks see it: a sampler per rank, iterated in lockstep."""

    def __init__(self, setup: Setup, address: str, world: int, incarnation: int, start_epoch: int, hint: bool,
                 prepare: Callable[[int, Sampler], None]) -> None:
        self.name = f"t{incarnation}-{uuid.uuid4().hex[:8]}"  # the incarnation the ranks join as
        self.world = world
        self.incarnation = incarnation  # its number in this run
        self.start_epoch = start_epoch  # the epoch its resume point is in
        self.hint = hint  # the loop calls set_epoch(epoch) on every rank before each epoch
        self.taken = [0] * world  # items (indices, or batches) of the epoch each rank has taken
        self.ended = [False] * world  # the rank's iteration of the epoch has ended
        samplers = [setup.sampler(address, incarnation=self.name, world=world, rank=r) for r in range(world)]
        try:
            for r, s in enumerate(samplers):
                prepare(r, s)
            self.ranks = Ranks(samplers)  # every rank joins; the generation starts
        except BaseException:
            for s in samplers:
                s.close()
            raise

    @property
    def samplers(self) -> list[Sampler]:
        return self.ranks.samplers

    def take(self, rank: int, batch: int) -> list[int]:
        """What `rank` gets in one step: up to `batch` indices (as torch's BatchSampler takes them) or one batch."""
        if isinstance(self.samplers[rank], DistributedBatchSampler):
            b = self.ranks.next(rank)
            if b is None:
                self.ended[rank] = True
                return []
            self.taken[rank] += 1
            return list(b)
        out: list[int] = []
        while len(out) < batch:
            i = self.ranks.next(rank)
            if i is None:
                self.ended[rank] = True
                break
            out.append(i)
        self.taken[rank] += len(out)
        return out

    def next_epoch(self, epoch: int) -> None:
        """The loop's next epoch: set_epoch on every rank (the usual loop), then new iterators."""
        if self.hint:
            for s in self.samplers:
                s.set_epoch(epoch)
        self.ranks.new_iterators()
        self.taken = [0] * self.world
        self.ended = [False] * self.world

    def close(self) -> None:
        self.ranks.close()


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint state without what names the checkpointing rank: its "origin" (incarnation and
    progress), its "items" (its own count, which ranks of uneven shares do not share), and the step
    and generation only the rank the trainer saves names (with the format version they bring)."""
    return {k: v for k, v in state.items() if k not in ("origin", "items", "step", "generation", "version")}


