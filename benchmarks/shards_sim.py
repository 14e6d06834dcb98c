"""Benchmark: shard-local orders, shuffle quality and shard fetches, beside MosaicML streaming and an HF-style buffer.

For one dataset in shards (S shards of equal size), every order is asked for the same epoch:

* shuffle quality, on the epoch dealt to the base world: (a) distinct shards per global batch,
  (b) the Spearman correlation between a sample's stored position (its dataset index) and its
  position in the epoch, globally and within each shard (row against position), (c) with shards
  that each hold one class (consecutive shards share a class), distinct classes per global batch
  and per rank batch;
* shard fetches, counted by a cache per node (in shards; a bounded one that evicts first the shards
  whose every row the node read, as croupier's reader does, the same bounded one with plain
  least-recently-used eviction, and an unbounded one), over a steady epoch, resizes (a shrink, a
  shrink and a grow back) and a rollback (resume from an older checkpoint once the job went
  further). Nodes keep their cache and their number across a resize; departed nodes' caches are
  gone, new nodes start empty.

The orders: croupier's shard order (``Spec.with_shards``) at several ``shard_window`` x ``lanes``
settings, croupier's global permutation (``feistel``, the quality ceiling), MosaicML streaming's
own ``get_shuffle`` (py1e, py1br, py1s, py2s) and ``get_partitions`` run in an environment of
their own (``--peer-env``, made on first use), and an HF-style shuffle buffer over shards read in a
shuffled shard order. The scale part repeats the fetch count at 1e9 samples in
1e5 shards on 64 nodes, and MosaicML at the largest N its O(N) arrays allow beside the same shards.

The caches are exact, per access, in small C routines compiled at run time (``cc``) and called
through ctypes; without a compiler, pure-Python caches (the same rules) are used, and the scale part
is left out. Both are checked against each other on random sequences at every run.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import heapq
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MOSAIC_PACKAGE = "mosaicml-streaming==0.13.0"
MOSAIC_ALGOS = ("py1e", "py1br", "py1s", "py2s")
#: What --orders picks from: croupier's global permutation, its shard order, MosaicML's, the HF-style buffer.
ORDER_FAMILIES = ("global", "croupier", "mosaic", "hf")
UNBOUNDED = 0  # a cache capacity of 0 stands for an unbounded cache


def _log(msg: str) -> None:
    print(f"[shards_sim {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Scenario:
    """A run of one epoch: the base run up to a checkpoint, then legs of other worlds.

    The base world runs the epoch from its start; the scenario takes the node caches the base run
    had at fraction `caches_at` of the epoch and resumes from the checkpoint taken at `resume_at`
    (equal for a resize; earlier for a rollback), then runs each leg (nodes, until fraction; 1.0 is
    the epoch's end). A scenario with no legs is the steady epoch.
    """

    name: str
    caches_at: float = 1.0
    resume_at: float = 1.0
    legs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Config:
    shards: int
    shard_size: int
    nodes: int
    ranks_per_node: int
    batch: int
    seed: int = 0
    epoch: int = 0
    classes: int = 1000
    #: -512: 512 shards, done shards first (croupier's reader); 512: the same, least recently used; 0: unbounded
    caches: tuple[int, ...] = (-512, 512, UNBOUNDED)
    windows: tuple[tuple[int, int], ...] = ()
    scenarios: tuple[Scenario, ...] = ()
    hf_buffer: int = 10_000
    mosaic_algos: tuple[str, ...] = MOSAIC_ALGOS
    mosaic_ncn: int | None = None  # None: StreamingDataset's default per algorithm
    quality: bool = True
    coverage: bool = True
    global_perm: bool = True
    chunk_steps: int = 2048
    belady: bool = False  # also the steady epoch's fetches under Belady's rule (croupier's shard orders)
    jobs: int = 1  # processes the nodes are split over

    @property
    def n(self) -> int:
        return self.shards * self.shard_size

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def global_batch(self) -> int:
        return self.world * self.batch


def _resize_scenarios(base: int, shrinks: tuple[int, ...], back: int) -> tuple[Scenario, ...]:
    out = [Scenario("steady epoch")]
    for k in shrinks:
        out.append(Scenario(f"{base} -> {k} nodes at 40%", 0.4, 0.4, ((k, 1.0),)))
    out.append(Scenario(f"{base} -> {back} -> {base} nodes (40%, 70%)", 0.4, 0.4, ((back, 0.7), (base, 1.0))))
    out.append(Scenario("rollback: at 50%, resume from the 30% checkpoint", 0.5, 0.3, ((base, 1.0),)))
    return tuple(out)


def main_config(quick: bool) -> Config:
    if quick:
        return Config(shards=64, shard_size=50, nodes=2, ranks_per_node=2, batch=4, classes=8, caches=(-8, 8, UNBOUNDED),
                      windows=((2, 2), (4, 2), (8, 4)), scenarios=_resize_scenarios(2, (1,), 1), hf_buffer=100,
                      chunk_steps=64)
    return Config(shards=10_000, shard_size=1_000, nodes=8, ranks_per_node=8, batch=32, classes=1000,
                  windows=((8, 16), (16, 16), (24, 16), (28, 16), (32, 16), (32, 8), (64, 8), (128, 4), (64, 16),
                           (256, 16), (625, 16)),
                  scenarios=_resize_scenarios(8, (6, 3), 4))


def scale_configs(quick: bool, scale_n: int, mosaic_n: int, algos: tuple[str, ...]) -> tuple[Config, Config]:
    """Item 4: croupier at `scale_n` samples in 1e5 shards; MosaicML (and croupier beside it) at `mosaic_n`."""
    if quick:
        scen = (Scenario("steady epoch"), Scenario("4 -> 3 -> 4 nodes (40%, 70%)", 0.4, 0.4, ((3, 0.7), (4, 1.0))),
                Scenario("rollback: at 50%, resume from the 30% checkpoint", 0.5, 0.3, ((4, 1.0),)))
        big = Config(shards=256, shard_size=100, nodes=4, ranks_per_node=2, batch=4, caches=(-16, 16, UNBOUNDED),
                     windows=((4, 2),), scenarios=scen, quality=False, chunk_steps=256)
        return big, replace(big, shard_size=50, mosaic_algos=algos, mosaic_ncn=4)
    shards = 100_000
    scen = (Scenario("steady epoch"),
            Scenario("64 -> 48 -> 64 nodes (40%, 70%)", 0.4, 0.4, ((48, 0.7), (64, 1.0))),
            Scenario("rollback: at 50%, resume from the 30% checkpoint", 0.5, 0.3, ((64, 1.0),)))
    big = Config(shards=shards, shard_size=scale_n // shards, nodes=64, ranks_per_node=8, batch=32,
                 windows=((32, 16),), scenarios=scen, quality=False, coverage=False, mosaic_algos=(),
                 chunk_steps=4096)
    small = replace(big, shard_size=mosaic_n // shards, mosaic_algos=algos, mosaic_ncn=64, coverage=True)
    return big, small


# --------------------------------------------------------------------------- the LRU cache

_LRU_C = r"""
#include <stdint.h>
/* One node's LRU cache of shards, read sample by sample: sample i is in shard samples[i] / size
   (every shard holds `size` samples; samples < 0 are padding and are skipped).
   hdr = {head (most recent), tail (least recent), count}; -1 is no shard.
   cap <= 0: unbounded (only `present` is kept; head is the last shard seen).
   With `reads` (not NULL) it is croupier's reader's rule (croupier.data, eviction "plan"): the shards whose
   every row of the epoch was read (reads[x] >= size: the plan needs them no more this epoch) are evicted
   first, the least recently used of them first, then the least recently used of the others; the shard
   read last is never evicted. `reads` counts every sample read per shard (from the board's seed at the
   last resume); dhdr[0] is how many shards held are done (none: no walk for one).
   Returns the misses (fetches). */
int64_t lru_access(const int64_t *samples, int64_t n, int64_t size, int64_t cap, int32_t *prv,
                   int32_t *nxt, uint8_t *present, int64_t *hdr, int32_t *reads, int64_t *dhdr) {
    int64_t misses = 0, count = hdr[2], nd = reads ? dhdr[0] : 0;
    int32_t head = (int32_t)hdr[0], tail = (int32_t)hdr[1];
    for (int64_t i = 0; i < n; i++) {
        if (samples[i] < 0) continue;
        int32_t x = (int32_t)(samples[i] / size);
        if (x != head) {
            if (cap <= 0) {
                if (!present[x]) { present[x] = 1; misses++; count++; }
                head = x;
                continue;
            }
            if (present[x]) {
                int32_t p = prv[x], q = nxt[x];
                nxt[p] = q;
                if (q >= 0) prv[q] = p; else tail = p;
            } else {
                misses++;
                if (count == cap) {
                    int32_t v = -1;
                    if (nd > 0) {  /* done first (reads given): the least recently used done shard */
                        v = tail;
                        while (v >= 0 && (reads[v] < size || v == head)) v = prv[v];
                    }
                    if (v < 0) v = tail;
                    if (reads && reads[v] >= size) nd--;
                    int32_t p = prv[v], q = nxt[v];
                    if (p >= 0) nxt[p] = q; else head = q;
                    if (q >= 0) prv[q] = p; else tail = p;
                    present[v] = 0;
                    count--;
                }
                present[x] = 1;
                count++;
                if (reads && reads[x] >= size) nd++;  /* a shard done before it came back (a seed's) */
            }
            prv[x] = -1;
            nxt[x] = head;
            if (head >= 0) prv[head] = x; else tail = x;
            head = x;
        }
        if (reads && ++reads[x] == size) nd++;
    }
    hdr[0] = head; hdr[1] = tail; hdr[2] = count;
    if (reads) dhdr[0] = nd;
    return misses;
}

/* counts[x] += 1 for every x >= 0 of samples. */
void count_add(const int64_t *samples, int64_t n, uint16_t *counts) {
    for (int64_t i = 0; i < n; i++) if (samples[i] >= 0) counts[samples[i]]++;
}
"""


def _compile_lru(build: Path) -> ctypes.CDLL | None:
    """The C routines above, compiled into `build`; None without a C compiler (or when it fails)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    build.mkdir(parents=True, exist_ok=True)
    tag = hashlib.sha256(_LRU_C.encode()).hexdigest()[:12]
    lib = build / f"lru_{tag}.so"
    if not lib.exists():
        src = build / f"lru_{tag}.c"
        src.write_text(_LRU_C)
        tmp = build / f"lru_{tag}.{os.getpid()}.so"
        proc = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(src)], capture_output=True, text=True)
        if proc.returncode != 0:
            _log(f"cc failed ({proc.stderr.strip()[:200]}): the pure-Python LRU is used")
            return None
        tmp.replace(lib)
    dll = ctypes.CDLL(str(lib))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    dll.lru_access.argtypes = [p, i64, i64, i64, p, p, p, p, p, p]
    dll.lru_access.restype = i64
    dll.count_add.argtypes = [p, i64, p]
    dll.count_add.restype = None
    return dll


class NodeCache:
    """One node's cache: an LRU of `capacity` shards (UNBOUNDED: every shard it read stays); a negative
    capacity -c: c shards, evicting first the shards whose every row the node read since its processes
    started (croupier's reader, ``eviction="plan"``), the least recently used otherwise."""

    lib: ctypes.CDLL | None = None

    def __init__(self, shards: int, capacity: int, shard_size: int) -> None:
        self.done_first = capacity < 0
        self.capacity, self.shard_size = abs(capacity), shard_size
        self.fetches = 0
        if self.done_first:
            self.reads = np.zeros(shards, dtype=np.int32)
            self.dhdr = np.zeros(1, dtype=np.int64)  # the done shards held
        if self.lib is not None:
            self.prv = np.full(shards, -1, dtype=np.int32)
            self.nxt = np.full(shards, -1, dtype=np.int32)
            self.present = np.zeros(shards, dtype=np.uint8)
            self.hdr = np.array([-1, -1, 0], dtype=np.int64)
        else:
            self.od: OrderedDict[int, None] = OrderedDict()

    def copy(self) -> NodeCache:
        other = NodeCache.__new__(NodeCache)
        other.capacity, other.fetches, other.shard_size = self.capacity, self.fetches, self.shard_size
        other.done_first = self.done_first
        if self.done_first:
            other.reads, other.dhdr = self.reads.copy(), self.dhdr.copy()
        if self.lib is not None:
            other.prv, other.nxt = self.prv.copy(), self.nxt.copy()
            other.present, other.hdr = self.present.copy(), self.hdr.copy()
        else:
            other.od = OrderedDict(self.od)
        return other

    def restart(self, read: np.ndarray | None) -> None:
        """The node's processes start again (a resize, a resume), the shards on disk stay. The reader's board
        starts from `read`, each shard's rows the epoch consumed before the resume point (``ShardedDataset.resume``
        seeds it so for a shard order), or from zero (None: an order whose board is not seeded)."""
        if self.done_first:
            self.reads[:] = 0 if read is None else read
            held = self.present.astype(bool) if self.lib is not None else np.isin(np.arange(self.reads.size), list(self.od))
            self.dhdr[0] = np.count_nonzero(held & (self.reads >= self.shard_size))  # evicted first from now on

    def access(self, samples: np.ndarray) -> int:
        """Reads the shards of `samples` in order (entries < 0 skipped); returns and counts the fetches."""
        samples = np.ascontiguousarray(samples, dtype=np.int64).reshape(-1)
        if self.lib is not None:
            done = (self.reads, self.dhdr) if self.done_first else ()
            a = [x.ctypes.data for x in (samples, self.prv, self.nxt, self.present, self.hdr, *done)]
            misses = int(self.lib.lru_access(*a[:1], samples.size, self.shard_size, self.capacity, *a[1:],
                                             *([None] * (2 - len(done)))))
        elif self.done_first:
            misses = _done_python(self, np.where(samples >= 0, samples // self.shard_size, -1))
        else:
            misses = _lru_python(self.od, np.where(samples >= 0, samples // self.shard_size, -1), self.capacity)
        self.fetches += misses
        return misses


def _done_python(c: NodeCache, seq: np.ndarray) -> int:
    """The done-first rule of ``lru_access`` (given `reads`), in Python (the same choices: the least recently used done
    shard goes first, else the least recently used; the most recent shard is never evicted)."""
    misses, od, size = 0, c.od, c.shard_size
    for x in seq.tolist():
        if x < 0:
            continue
        head = next(reversed(od)) if od else -1
        if x != head:
            if x in od:
                od.move_to_end(x)
            else:
                misses += 1
                if len(od) == c.capacity:
                    v = next((d for d in od if c.reads[d] >= size and d != head), next(iter(od)))
                    del od[v]
                od[x] = None
        c.reads[x] += 1
    return misses


def _lru_python(od: OrderedDict[int, None], seq: np.ndarray, cap: int) -> int:
    misses = 0
    for x in seq.tolist():
        if x < 0:
            continue
        if x in od:
            od.move_to_end(x)
            continue
        misses += 1
        od[x] = None
        if 0 < cap < len(od):
            od.popitem(last=False)
    return misses


def _check_lru() -> None:
    """The compiled LRU and the Python one agree on random sequences (also across calls)."""
    rng = np.random.default_rng(7)
    for cap in (1, 3, 17, UNBOUNDED):
        od: OrderedDict[int, None] = OrderedDict()
        cache = NodeCache(128, cap, 3)
        py = c = 0
        for part in range(3):
            samples = rng.integers(-1, 3 * (40 + 20 * part), 5000)
            py += _lru_python(od, np.where(samples >= 0, samples // 3, -1), cap)
            c += cache.access(samples)
        if py != c:
            raise AssertionError(f"compiled LRU disagrees with the Python one at capacity {cap}: {c} != {py}")
    if NodeCache.lib is None:
        return
    for cap in (1, 3, 17):
        compiled = NodeCache(128, -cap, 3)
        NodeCache.lib, lib = None, NodeCache.lib
        seqs = [rng.permutation(3 * 40 * (1 + part)) for part in range(3)]
        seeds = [rng.integers(0, 4, 128) for _ in seqs]  # a resume's seed before each part (rows read, up to 3)
        try:
            python = NodeCache(128, -cap, 3)
            py = 0
            for x, seed in zip(seqs, seeds):
                python.restart(seed)
                py += python.access(x)
        finally:
            NodeCache.lib = lib
        c = 0
        for x, seed in zip(seqs, seeds):
            compiled.restart(seed)
            c += compiled.access(x)
        if py != c:
            raise AssertionError(f"compiled done-first cache disagrees with the Python one at capacity {cap}: {c} != {py}")


# --------------------------------------------------------------------------- orders: legs of an epoch


class Leg:
    """One generation's share of an epoch: `steps` lockstep steps of `nodes` x ranks_per_node ranks."""

    nodes: int
    steps: int

    def node_samples(self, g: int, first: int, count: int) -> np.ndarray:
        """Dataset indices node `g` reads in steps first .. first + count - 1: (count, ranks, batch), -1 pads."""
        raise NotImplementedError

    def resume(self, j: int) -> Any:
        """The resume point once every rank took `j` steps of this leg."""
        raise NotImplementedError

    def consumed(self) -> np.ndarray | None:
        """What the node's reader starts its board from when this leg's processes start: each shard's rows the
        epoch consumed before the leg (None: the board starts at zero, as for every order but croupier's shard
        order, whose ``ShardedDataset.resume`` seeds it)."""
        return None


class CroupierLeg(Leg):
    def __init__(self, spec: Any, cursor: Any, nodes: int, rpn: int) -> None:
        from croupier.core.registry import plan_epoch

        self.nodes, self.rpn, self.batch = nodes, rpn, spec.batch_size
        plan = plan_epoch(spec, cursor, nodes * rpn, cursor.epoch)
        assert plan is not None
        self.plan, self.spec, self.cursor = plan, spec, cursor
        self.steps = max(plan.steps(r) for r in range(nodes * rpn))
        self._consumed: np.ndarray | None = None

    def node_samples(self, g: int, first: int, count: int) -> np.ndarray:
        out = np.full((count, self.rpn, self.batch), -1, dtype=np.int64)
        for k in range(self.rpn):
            idx, sizes = self.plan.lease(g * self.rpn + k, first, count)
            if len(sizes) == count and all(s == self.batch for s in sizes):
                out[:, k, :] = idx.reshape(count, self.batch)
                continue
            # a rank's last batch may be short (the epoch's rows per rank need not divide by the batch)
            at = 0
            for step, size in enumerate(sizes):
                out[step, k, :size] = idx[at:at + size]
                at += size
        return out

    def resume(self, j: int) -> Any:
        return self.plan.advance(j)

    def consumed(self) -> np.ndarray | None:
        from croupier.core.shards import consumed_rows

        if self.spec.permutation != "shards":
            return None  # the reader seeds no board for another order (croupier.data._board.seed_at)
        if self._consumed is None:  # the same for every node: computed once
            self._consumed = consumed_rows(self.spec, self.cursor).astype(np.int32)
        return self._consumed


class ArrayLeg(Leg):
    """A leg held as an array (nodes, ranks_per_node, steps, batch) of dataset indices, -1 pads."""

    def __init__(self, ids: np.ndarray, drop_first: int, global_batch: int) -> None:
        self.ids, self.drop_first, self.gb = ids, drop_first, global_batch
        self.nodes, self.steps = ids.shape[0], ids.shape[2]

    def node_samples(self, g: int, first: int, count: int) -> np.ndarray:
        return np.asarray(self.ids[g, :, first:first + count, :]).transpose(1, 0, 2)

    def resume(self, j: int) -> Any:
        return self.drop_first + j * self.gb


@dataclass
class OrderRun:
    """What one order gave: quality figures and, per scenario, fetches per cache and coverage."""

    name: str
    family: str  # "croupier", "global", "mosaic", "hf"
    settings: str
    quality: dict[str, float] = field(default_factory=dict)
    fetches: dict[str, dict[int, float]] = field(default_factory=dict)  # scenario -> capacity -> fetches / S
    skew: dict[str, float] = field(default_factory=dict)  # scenario -> max / mean fetches per node (first cache)
    coverage: dict[str, tuple[int, int]] = field(default_factory=dict)  # scenario -> (repeated, unseen)
    notes: dict[str, str] = field(default_factory=dict)  # scenario -> refusal or why not run
    seconds: float = 0.0


# --------------------------------------------------------------------------- quality


def quality(cfg: Config, epoch: np.ndarray) -> dict[str, float]:
    """(a), (b), (c) of an epoch laid out as (steps, world, batch) dataset indices, complete steps only."""
    steps = epoch.shape[0]
    flat = epoch.reshape(-1)
    shard = (flat // cfg.shard_size).astype(np.int32)
    rows = np.sort(shard.reshape(steps, -1), axis=1)
    distinct = 1 + np.count_nonzero(np.diff(rows, axis=1), axis=1)
    cls = (shard.astype(np.int64) * cfg.classes // cfg.shards).astype(np.int32)
    crow = np.sort(cls.reshape(steps, -1), axis=1)
    classes_g = 1 + np.count_nonzero(np.diff(crow, axis=1), axis=1)
    rb = np.sort(cls.reshape(-1, cfg.batch), axis=1)
    classes_r = 1 + np.count_nonzero(np.diff(rb, axis=1), axis=1)
    # (b) global: rank of each index among those dealt (the epoch may drop a tail) against its position
    seen = np.zeros(cfg.n, dtype=bool)
    seen[flat] = True
    rank = np.cumsum(seen, dtype=np.int64)[flat] - 1
    pos = np.arange(flat.size, dtype=np.float64)
    rho = float(np.corrcoef(rank.astype(np.float64), pos)[0, 1])
    # (b) within shards: Spearman of (row in shard, position in epoch) per shard, averaged over shards
    by_pos = np.argsort(shard, kind="stable")  # within a shard: epoch order
    m = np.bincount(shard, minlength=cfg.shards)
    start = np.concatenate(([0], np.cumsum(m)[:-1]))
    rank_pos = np.empty(flat.size, dtype=np.int64)
    rank_pos[by_pos] = np.arange(flat.size) - np.repeat(start, m)
    rank_row = rank - start[shard]  # rows of a shard are consecutive indices: their rank among the shard's dealt rows
    d2 = np.bincount(shard, weights=((rank_pos - rank_row).astype(np.float64)) ** 2, minlength=cfg.shards)
    ok = m >= 3
    mf = m[ok].astype(np.float64)
    rho_in = 1 - 6 * d2[ok] / (mf * (mf * mf - 1))
    return {
        "distinct": float(distinct.mean()),
        "rho": rho,
        "rho_in": float(rho_in.mean()),
        "classes_g": float(classes_g.mean()),
        "classes_r": float(classes_r.mean()),
        "steps": float(steps),
    }


def _complete_epoch(leg: Leg, cfg: Config) -> np.ndarray:
    """The base leg's epoch as (steps, world, batch), its incomplete last steps left out."""
    parts = [leg.node_samples(g, 0, leg.steps) for g in range(leg.nodes)]  # (steps, rpn, batch) each
    ep = np.concatenate(parts, axis=1)
    full = (ep >= 0).all(axis=(1, 2))
    last = int(np.argmin(full)) if not full.all() else ep.shape[0]
    return ep[:last]


# --------------------------------------------------------------------------- fetches


class Caches:
    """The caches of every node of a job, one set per capacity."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.nodes: dict[int, list[NodeCache]] = {}
        self.departed: list[list[int]] = []  # fetch counts of nodes that left

    def copy(self) -> Caches:
        other = Caches(self.cfg)
        other.nodes = {g: [c.copy() for c in cs] for g, cs in self.nodes.items()}
        other.departed = [list(x) for x in self.departed]
        return other

    def resize(self, nodes: int) -> None:
        for g in [g for g in self.nodes if g >= nodes]:
            self.departed.append([c.fetches for c in self.nodes.pop(g)])

    def node(self, g: int) -> list[NodeCache]:
        if g not in self.nodes:
            self.nodes[g] = [NodeCache(self.cfg.shards, cap, self.cfg.shard_size) for cap in self.cfg.caches]
        return self.nodes[g]

    def read(self, g: int, samples: np.ndarray) -> None:
        samples = np.ascontiguousarray(samples, dtype=np.int64).reshape(-1)
        for c in self.node(g):
            c.access(samples)

    def per_node(self) -> list[list[int]]:
        """Fetches of every node that took part (those here and those that left), per capacity."""
        return [[c.fetches for c in cs] for cs in self.nodes.values()] + [list(x) for x in self.departed]


def _count(counts: np.ndarray | None, samples: np.ndarray) -> None:
    if counts is None:
        return
    x = np.ascontiguousarray(samples, dtype=np.int64).reshape(-1)
    if NodeCache.lib is not None:
        NodeCache.lib.count_add(x.ctypes.data, x.size, counts.ctypes.data)
    else:
        np.add.at(counts, x[x >= 0], 1)


def _run_leg(cfg: Config, leg: Leg, caches: Caches, steps: int, counts: np.ndarray | None,
             mine: Callable[[int], bool]) -> None:
    """Runs `steps` steps of `leg` through the caches of the nodes `mine` picks, node by node (the caches are per node)."""
    caches.resize(leg.nodes)
    for g in filter(mine, range(leg.nodes)):
        for c in caches.node(g):
            c.restart(leg.consumed())
        for first in range(0, steps, cfg.chunk_steps):
            samples = leg.node_samples(g, first, min(cfg.chunk_steps, steps - first))
            caches.read(g, samples)
            _count(counts, samples)


def _steps_to(cfg: Config, fraction: float, done: int, gb: int) -> int:
    return max(0, (round(fraction * cfg.n) - done) // gb)


Raw = dict[str, tuple[list[list[int]], "np.ndarray | None", str]]  # scenario -> (fetches per node, counts, refusal)


def simulate(cfg: Config, run: OrderRun, make_leg: Callable[[Any, int, int | None], Leg | str], start: Any,
             jobs: int = 1) -> None:
    """Fills `run`'s fetches, skew and coverage for every scenario of `cfg`.

    `make_leg(resume point, nodes, steps needed or None for all)` gives a leg, or a string: the
    order's refusal. Nodes are independent (each has its own cache), so `jobs` > 1 splits them
    over that many forked processes (node g to process g mod jobs) and adds their results up.
    """
    if jobs <= 1:
        raw = _simulate(cfg, make_leg, start, lambda g: True)
    else:
        import multiprocessing as mp

        ctx = mp.get_context("fork")
        queue = ctx.Queue()

        def child(j: int) -> None:
            queue.put((j, _simulate(cfg, make_leg, start, lambda g: g % jobs == j)))

        procs = [ctx.Process(target=child, args=(j,)) for j in range(jobs)]
        for pr in procs:
            pr.start()
        parts = [queue.get() for _ in procs]
        for pr in procs:
            pr.join()
            if pr.exitcode != 0:
                raise RuntimeError(f"a simulation process failed (exit code {pr.exitcode})")
        raw = {}
        for _, part in sorted(parts, key=lambda x: x[0]):
            for name, (per, counts, refused) in part.items():
                if name not in raw:
                    raw[name] = (list(per), None if counts is None else counts.copy(), refused)
                    continue
                acc = raw[name][1]
                if acc is not None and counts is not None:
                    acc += counts
                raw[name][0].extend(per)
    for sc in cfg.scenarios:
        per, counts, refused = raw[sc.name]
        if refused:
            run.notes[sc.name] = refused
        else:
            _record(cfg, run, sc.name, per, counts)


def _simulate(cfg: Config, make_leg: Callable[[Any, int, int | None], Leg | str], start: Any,
              mine: Callable[[int], bool]) -> Raw:
    """The scenarios for the nodes `mine` picks. The base run goes through the whole epoch once;
    each node's caches (and the samples dealt so far) are kept at the checkpoints the other
    scenarios branch from."""
    out: Raw = {}
    base = make_leg(start, cfg.nodes, None)
    assert isinstance(base, Leg)
    gb = cfg.global_batch
    fractions = sorted({f for s in cfg.scenarios if s.legs for f in (s.caches_at, s.resume_at)})
    steps_at = {f: min(_steps_to(cfg, f, 0, gb), base.steps) for f in fractions}
    stops = sorted({0, base.steps, *steps_at.values()})
    caches = Caches(cfg)
    cache_stops = {steps_at[s.caches_at] for s in cfg.scenarios[1:]}
    count_stops = {steps_at[s.resume_at] for s in cfg.scenarios[1:]} | {base.steps}
    at_stop = {s: Caches(cfg) for s in cache_stops}
    # samples dealt in each stretch between stops (uint16: no sample is dealt 65,535 times)
    seg = {s: np.zeros(cfg.n, dtype=np.uint16) for s in stops[1:]} if cfg.coverage else None
    caches.resize(base.nodes)
    for g in filter(mine, range(base.nodes)):
        for a, b in zip(stops[:-1], stops[1:]):
            for first in range(a, b, cfg.chunk_steps):
                samples = base.node_samples(g, first, min(cfg.chunk_steps, b - first))
                caches.read(g, samples)
                _count(None if seg is None else seg[b], samples)
            if b in at_stop:
                at_stop[b].nodes[g] = [c.copy() for c in caches.node(g)]
    counts_at: dict[int, np.ndarray | None] = {s: None for s in stops}
    if seg is not None:
        acc = np.zeros(cfg.n, dtype=np.uint16)
        for s in stops:
            if s in seg:
                acc += seg.pop(s)
            if s in count_stops:
                counts_at[s] = acc.copy()
    out[cfg.scenarios[0].name] = (caches.per_node(), counts_at[base.steps], "")
    for sc in cfg.scenarios[1:]:
        cs = at_stop[steps_at[sc.caches_at]].copy()
        j = steps_at[sc.resume_at]
        resume, done = base.resume(j), j * gb
        cnt = counts_at[j]
        cnt = None if cnt is None else cnt.copy()
        refused = ""
        for k, (nodes, until) in enumerate(sc.legs):
            last = k == len(sc.legs) - 1
            lgb = nodes * cfg.ranks_per_node * cfg.batch
            need = None if last else _steps_to(cfg, until, done, lgb)
            leg = make_leg(resume, nodes, need)
            if isinstance(leg, str):
                refused = f"{nodes} nodes: {leg}"
                break
            steps = leg.steps if need is None else min(need, leg.steps)
            _run_leg(cfg, leg, cs, steps, cnt, mine)
            done += steps * lgb
            resume = leg.resume(steps)
        out[sc.name] = (cs.per_node(), cnt, refused)
    return out


def _record(cfg: Config, run: OrderRun, name: str, per_node: list[list[int]], counts: np.ndarray | None) -> None:
    totals = [sum(p[i] for p in per_node) for i in range(len(cfg.caches))]
    run.fetches[name] = {cap: t / cfg.shards for cap, t in zip(cfg.caches, totals)}
    first = [p[0] for p in per_node]
    run.skew[name] = max(first) / (sum(first) / len(first)) if sum(first) else float("nan")
    if counts is not None:
        dealt, distinct = int(counts.sum(dtype=np.int64)), int(np.count_nonzero(counts))
        run.coverage[name] = (dealt - distinct, cfg.n - distinct)


# --------------------------------------------------------------------------- croupier's orders


def croupier_spec(cfg: Config, window: tuple[int, int] | None) -> Any:
    """The shard order's spec (`window` = (shard_window, lanes)), or the global permutation's (None)."""
    from croupier.core.spec import Spec

    if window is None:
        return Spec(n=cfg.n, batch_size=cfg.batch, seed=cfg.seed, tail="drop")
    sizes = np.full(cfg.shards, cfg.shard_size, dtype=np.int64)
    return Spec.with_shards(sizes, batch_size=cfg.batch, seed=cfg.seed, shard_window=window[0], lanes=window[1],
                            reader_group=cfg.ranks_per_node, tail="drop")


def run_croupier(cfg: Config, window: tuple[int, int] | None) -> OrderRun:
    from croupier.core.cursor import fresh

    t0 = time.perf_counter()
    if window is None:
        run = OrderRun("croupier global permutation", "global", "feistel")
    else:
        run = OrderRun(f"croupier shards {window[0]} x {window[1]}", "croupier",
                       f"shard_window {window[0]}, lanes {window[1]}")
    spec = croupier_spec(cfg, window)

    def make(cursor: Any, nodes: int, _need: int | None) -> Leg:
        return CroupierLeg(spec, cursor, nodes, cfg.ranks_per_node)

    start = fresh(spec, cfg.epoch)
    if cfg.quality:
        run.quality = quality(cfg, _complete_epoch(make(start, cfg.nodes, None), cfg))
    if cfg.belady and window is not None:
        run.notes["belady"], run.notes["floor"] = (f"{x:.3f}" for x in belady(cfg, make(start, cfg.nodes, None)))
    simulate(cfg, run, make, start, cfg.jobs)
    run.seconds = time.perf_counter() - t0
    return run


def belady(cfg: Config, leg: Leg) -> tuple[float, float]:
    """The steady epoch's fetches / S at the bounded cache size if each node evicted the shard its plan reads
    next furthest in the future (Belady's rule, the least possible: the plan knows the node's whole epoch), and
    the floor no rule beats: the shards each node reads at all, added over the nodes."""
    cap = abs(cfg.caches[0])
    fetched = floor = 0
    for g in range(leg.nodes):
        x = leg.node_samples(g, 0, leg.steps).reshape(-1)
        seq = x[x >= 0] // cfg.shard_size
        seq = seq[np.concatenate([[True], seq[1:] != seq[:-1]])]  # (accesses,) runs of one shard as one
        n = seq.size
        order = np.lexsort((np.arange(n), seq))
        nxt = np.full(n, n, dtype=np.int64)  # (accesses,) the next access of the same shard (n: none)
        same = seq[order[1:]] == seq[order[:-1]]
        nxt[order[:-1][same]] = order[1:][same]
        held: dict[int, int] = {}  # shard -> its next access
        heap: list[tuple[int, int]] = []  # (-next access, shard), stale entries skipped
        for shard, nu in zip(seq.tolist(), nxt.tolist()):
            if shard not in held:
                fetched += 1
                while len(held) >= cap:
                    far, y = heapq.heappop(heap)
                    if held.get(y) == -far:
                        del held[y]
            held[shard] = nu
            heapq.heappush(heap, (-nu, shard))
        floor += np.unique(seq).size
    return fetched / cfg.shards, floor / cfg.shards


# --------------------------------------------------------------------------- the HF-style buffer


def _buffer_shuffle(stream: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """HF ``IterableDataset.shuffle``'s buffer: once full, each new sample takes the place of a random one, which is yielded."""
    n = stream.size
    if n <= size:
        return rng.permutation(stream)
    src = stream.tolist()
    buf = src[:size]
    picks = rng.integers(0, size, n - size).tolist()
    out = []
    append = out.append
    for k, i in enumerate(picks):
        append(buf[i])
        buf[i] = src[size + k]
    return np.concatenate([np.asarray(out, dtype=np.int64), rng.permutation(np.asarray(buf, dtype=np.int64))])


def run_hf(cfg: Config) -> OrderRun:
    """Shards in a shuffled order dealt round robin to the ranks, each rank's rows read in stored order
    through its own buffer of `cfg.hf_buffer`."""
    t0 = time.perf_counter()
    run = OrderRun(f"HF-style buffer {cfg.hf_buffer:,}", "hf", "shuffled shard order, a buffer per rank")
    rng = np.random.default_rng(cfg.seed + cfg.epoch)
    order = rng.permutation(cfg.shards)
    streams, reads = [], []
    for r in range(cfg.world):
        mine = order[r::cfg.world]
        rows = (mine[:, None] * cfg.shard_size + np.arange(cfg.shard_size)[None, :]).reshape(-1)
        reads.append(rows)
        streams.append(_buffer_shuffle(rows, cfg.hf_buffer, rng))
    steps = min(s.size for s in streams) // cfg.batch
    ep = np.stack([s[:steps * cfg.batch].reshape(steps, cfg.batch) for s in streams], axis=1)
    if cfg.quality:
        run.quality = quality(cfg, ep)
    # fetches: a shard is fetched when a rank reads it into its buffer; each rank reads its shards once, in order
    caches = Caches(cfg)
    for g in range(cfg.nodes):
        for k in range(cfg.ranks_per_node):
            caches.read(g, reads[g * cfg.ranks_per_node + k])
    counts = None
    if cfg.coverage:
        counts = np.bincount(ep.reshape(-1), minlength=cfg.n).astype(np.uint16)
    _record(cfg, run, cfg.scenarios[0].name, caches.per_node(), counts)
    for sc in cfg.scenarios[1:]:
        run.notes[sc.name] = "no exact resume (not simulated)"
    run.seconds = time.perf_counter() - t0
    return run


# --------------------------------------------------------------------------- MosaicML streaming


def ensure_peer_env(env: Path) -> Path:
    """The peer environment's python, made on first use: mosaicml-streaming (no dependencies) and numpy < 2.2."""
    py = env / "bin" / "python"
    marker = env / ".mosaic-installed"
    if py.exists() and marker.exists():
        return py
    _log(f"creating the MosaicML environment in {env} ({MOSAIC_PACKAGE}, numpy<2.2)")
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    MOSAIC_PACKAGE, "numpy<2.2"], check=True)
    marker.write_text(MOSAIC_PACKAGE + "\n")
    return py


def _mosaic_block(algo: str, ncn: int) -> int:
    """StreamingDataset's default shuffle_block_size."""
    return max(4_000_000 // ncn, 1 << 18)


def _mosaic_ncn(cfg: Config, algo: str) -> int:
    """StreamingDataset's default num_canonical_nodes (64 x nodes for py1s and py2s, nodes otherwise)."""
    if cfg.mosaic_ncn is not None:
        return cfg.mosaic_ncn
    return 64 * cfg.nodes if algo in ("py1s", "py2s") else cfg.nodes


def _peer_worker(request_path: str) -> int:
    """Runs in the peer environment: MosaicML's own partition and shuffle, as its ``random`` batching calls them.

    Only ``streaming.base.shuffle`` and ``streaming.base.partition`` are imported (numpy only): the
    packages above them are stood in by empty package modules, as ``streaming/__init__`` imports torch.
    """
    import importlib.metadata
    import importlib.util
    import types

    req = json.loads(Path(request_path).read_text())
    found = importlib.util.find_spec("streaming")
    assert found is not None and found.submodule_search_locations
    root = list(found.submodule_search_locations)[0]
    for name, path in (("streaming", root), ("streaming.base", os.path.join(root, "base"))):
        mod = types.ModuleType(name)
        mod.__path__ = [path]
        sys.modules[name] = mod
    from streaming.base.partition import get_partitions  # type: ignore[import-not-found]
    from streaming.base.shuffle import get_shuffle  # type: ignore[import-not-found]

    sizes = np.load(req["sizes"])
    n = int(sizes.sum())
    t0 = time.perf_counter()
    shuffle = get_shuffle(req["algo"], sizes, req["ncn"], req["seed"], req["epoch"], req["block_size"])
    out: dict[str, Any] = {"version": importlib.metadata.version("mosaicml-streaming"), "numpy": np.__version__,
                           "shuffle_s": time.perf_counter() - t0, "legs": []}
    for leg in req["legs"]:
        res: dict[str, Any] = {}
        nodes, initial = leg["nodes"], leg["initial"]
        ncn = req["ncn"]
        if ncn % nodes and nodes % ncn:  # 'orig' refuses these at once: record its words
            try:
                get_partitions("orig", n, ncn, nodes, req["rpn"], 1, req["batch"], leg["drop_first"], initial)
            except ValueError as e:
                res["orig_refused"] = str(e)
        try:
            ids = get_partitions(req["partition_algo"], n, ncn, nodes, req["rpn"], 1, req["batch"], leg["drop_first"],
                                 initial)
        except ValueError as e:
            res["refused"] = str(e)
            out["legs"].append(res)
            continue
        ids = np.where(ids != -1, shuffle[ids], -1)[:, :, 0]  # (nodes, ranks, steps, batch); one worker per rank
        steps = ids.shape[2] if leg["steps"] is None else min(leg["steps"], ids.shape[2])
        np.save(leg["out"], ids[:, :, :steps].astype(np.int32 if n < 2**31 else np.int64))
        res.update(steps=int(steps), total_steps=int(ids.shape[2]))
        out["legs"].append(res)
        del ids
    import resource

    out["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))
    return 0


def run_mosaic(cfg: Config, algo: str, py: Path, work: Path) -> OrderRun:
    """MosaicML's order for every scenario: its resumption is a new partition with ``drop_first`` the samples
    seen, the same canonical nodes, ``initial_physical_nodes`` the first run's nodes."""
    t0 = time.perf_counter()
    ncn = _mosaic_ncn(cfg, algo)
    block = _mosaic_block(algo, ncn)
    run = OrderRun(f"MosaicML {algo}", "mosaic", f"canonical nodes {ncn}" +
                   (f", block {block:,}" if algo in ("py1e", "py1br") else ""))
    work.mkdir(parents=True, exist_ok=True)
    sizes_path = work / "sizes.npy"
    np.save(sizes_path, np.full(cfg.shards, cfg.shard_size, dtype=np.int64))
    gb_of = {k: k * cfg.ranks_per_node * cfg.batch for k in range(1, 4 * cfg.nodes + 1)}
    # The legs, worked out as `simulate` will ask for them: the same steps, the same samples seen.
    legs: list[dict[str, Any]] = [{"nodes": cfg.nodes, "drop_first": 0, "steps": None, "initial": None}]
    for sc in cfg.scenarios[1:]:
        done = _steps_to(cfg, sc.resume_at, 0, cfg.global_batch) * cfg.global_batch
        for k, (nodes, until) in enumerate(sc.legs):
            last = k == len(sc.legs) - 1
            need = None if last else _steps_to(cfg, until, done, gb_of[nodes])
            legs.append({"nodes": nodes, "drop_first": done, "steps": need, "initial": cfg.nodes})
            done += (need or 0) * gb_of[nodes]
    keyed: dict[tuple[int, int, int | None], int] = {}
    for i, leg in enumerate(legs):
        leg["out"] = str(work / f"{algo}_leg{i}.npy")
        keyed.setdefault((leg["nodes"], leg["drop_first"], leg["steps"]), i)
    req = {"sizes": str(sizes_path), "algo": algo, "ncn": ncn, "seed": cfg.seed, "epoch": cfg.epoch, "block_size": block,
           "rpn": cfg.ranks_per_node, "batch": cfg.batch, "partition_algo": "relaxed", "legs": legs}
    req_path = work / f"{algo}_request.json"
    req_path.write_text(json.dumps(req))
    proc = subprocess.run([str(py), str(Path(__file__).resolve()), "--peer-request", str(req_path)],
                          capture_output=True, text=True, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"the MosaicML worker failed ({algo}): {proc.stderr[-2000:]}")
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    run.notes["version"] = f"mosaicml-streaming {answer['version']}, numpy {answer['numpy']}"
    run.notes["peak"] = f"{answer['maxrss_mb'] / 1024:.1f}"
    results = answer["legs"]

    def make(drop_first: int, nodes: int, need: int | None) -> Leg | str:
        i = keyed.get((nodes, drop_first, need))
        if i is None:
            raise AssertionError(f"no MosaicML leg was made for {nodes} nodes from sample {drop_first} ({need} steps)")
        res = results[i]
        if "refused" in res:
            return f"refused: {res['refused']}"
        return ArrayLeg(np.load(legs[i]["out"], mmap_mode="r"), drop_first, gb_of[nodes])

    refusing = sorted({leg["nodes"] for leg, res in zip(legs, results) if "orig_refused" in res}, reverse=True)
    if refusing:
        words = next(res["orig_refused"] for res in results if "orig_refused" in res)
        run.notes["orig"] = f"{' and '.join(map(str, refusing))} nodes: partition 'orig' refuses: {words}"

    base = make(0, cfg.nodes, None)
    assert isinstance(base, Leg)
    if cfg.quality:
        run.quality = quality(cfg, _complete_epoch(base, cfg))
    simulate(cfg, run, make, 0, cfg.jobs)
    for leg in legs:
        Path(leg["out"]).unlink(missing_ok=True)
    run.seconds = time.perf_counter() - t0
    return run


# --------------------------------------------------------------------------- report


def _f(x: float, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"


def _ratio(x: float, ref: float) -> str:
    if not ref:
        return "-"
    r = x / ref
    return f"{r:.2f}" if r >= 0.1 or r == 0 else f"{r:.2g}"


def quality_table(cfg: Config, runs: list[OrderRun], ref: OrderRun | None) -> list[str]:
    steady = cfg.scenarios[0].name
    caps = cfg.caches
    head = ("| order | settings | distinct shards / global batch | vs global perm. | Spearman index / epoch position "
            "| within-shard Spearman (row / position) | classes / global batch | vs global perm. "
            "| classes / rank batch | vs global perm. | " + " | ".join(f"fetches / S, {_cap(c)}" for c in caps) + " |")
    lines = [head, "|" + "---|" * (10 + len(caps))]
    for r in runs:
        if not r.quality:
            continue
        q, rq = r.quality, (ref.quality if ref else {})
        fetch = " | ".join(_f(r.fetches.get(steady, {}).get(c, float("nan"))) for c in caps)
        lines.append(f"| {r.name} | {r.settings} | {q['distinct']:,.1f} | {_ratio(q['distinct'], rq.get('distinct', 0))} "
                     f"| {q['rho']:+.4f} | {q['rho_in']:+.3f} | {q['classes_g']:,.1f} "
                     f"| {_ratio(q['classes_g'], rq.get('classes_g', 0))} | {q['classes_r']:.2f} "
                     f"| {_ratio(q['classes_r'], rq.get('classes_r', 0))} | {fetch} |")
    return lines


def _cap(c: int) -> str:
    return "unbounded cache" if c == UNBOUNDED else f"cache {-c}, done first" if c < 0 else f"cache {c}"


def fetch_table(cfg: Config, runs: list[OrderRun], scenario: str, ref: OrderRun | None) -> list[str]:
    caps = cfg.caches
    cols = []
    for c in caps:
        cols += [f"fetches / S, {_cap(c)}", "x global perm."]
    head = "| order | " + " | ".join(cols) + f" | node skew (max / mean, {_cap(caps[0])}) | repeated / unseen samples |"
    lines = [head, "|" + "---|" * (3 + 2 * len(caps))]
    for r in runs:
        if scenario not in r.fetches:
            note = r.notes.get(scenario, "not run")
            lines.append(f"| {r.name} | {note} |" + " |" * (1 + 2 * len(caps)))
            continue
        cells = []
        for c in caps:
            v = r.fetches[scenario][c]
            refv = ref.fetches.get(scenario, {}).get(c) if ref else None
            cells += [_f(v), _ratio(v, refv) if refv else "-"]
        cov = r.coverage.get(scenario)
        covs = "-" if cov is None else f"{cov[0]:,} / {cov[1]:,}"
        lines.append(f"| {r.name} | " + " | ".join(cells) + f" | {_f(r.skew.get(scenario, float('nan')))} | {covs} |")
    return lines


def plot(path: Path, cfg: Config, runs: list[OrderRun], ref: OrderRun | None, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steady = cfg.scenarios[0].name
    cap = cfg.caches[0]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    colors = {"croupier": "tab:blue", "global": "tab:red", "mosaic": "tab:green", "hf": "tab:orange"}
    refd = ref.quality["distinct"] if ref and ref.quality else None
    for ax, worst in zip(axes, (False, True)):
        for i, r in enumerate(runs):
            if not r.quality or not refd:
                continue
            if worst:
                vals = [r.fetches[s.name][cap] for s in cfg.scenarios[1:] if s.name in r.fetches]
                if not vals:
                    continue
                x = max(vals)
                refused = r.family != "hf" and any(s.name in r.notes for s in cfg.scenarios[1:])
            else:
                x, refused = r.fetches[steady][cap], False
            y = r.quality["distinct"] / refd
            ax.scatter([x], [y], color=colors[r.family], marker="x" if refused else "o", s=40)
            ax.annotate(r.name.replace("croupier ", "").replace("MosaicML ", ""), (x, y), fontsize=7,
                        xytext=(5, 7 * (i % 3) - 7), textcoords="offset points")  # staggered: neighbours overlap less
        py1e = next((r for r in runs if r.name == "MosaicML py1e" and r.quality), None)
        if py1e is not None:
            ax.axhline(py1e.quality["distinct"] / refd, color="tab:green", lw=0.8, ls="--")
            ax.text(1.0, py1e.quality["distinct"] / refd, " py1e's quality (the floor)",
                    fontsize=7, color="tab:green", va="bottom")
        ax.axvline(1.25 if worst else 1.05, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_xlabel(f"shards fetched / S, {_cap(cap)}" + (": worst of the resizes and the rollback" if worst
                                                            else ": steady epoch"))
        ax.set_ylabel("(a) distinct shards per global batch / global permutation's")
        ax.set_title("dotted: the fetch target (" + ("1.25 x S through a resize or rollback" if worst
                                                      else "1.05 x S in a steady epoch") + ")", fontsize=8)
        ax.axhline(1.0, color="grey", lw=0.6)
        ax.grid(True, which="both", lw=0.3)
    handles = [plt.Line2D([], [], color=c, marker="o", ls="", label=k) for k, c in colors.items()]
    if any(s.name in r.notes for r in runs for s in cfg.scenarios[1:] if r.family != "hf"):
        handles.append(plt.Line2D([], [], color="k", marker="x", ls="", label="a resize refused (worst of the rest)"))
    axes[0].legend(handles=handles, fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scale(path: Path, parts: list[tuple[str, Config, list[OrderRun]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(parts), figsize=(6.5 * len(parts), 4.8), squeeze=False)
    for ax, (title, cfg, runs) in zip(axes[0], parts):
        names = [s.name for s in cfg.scenarios]
        width = 0.8 / max(1, len(runs))
        for i, r in enumerate(runs):
            ys = [r.fetches.get(n, {}).get(cfg.caches[0], 0.0) for n in names]
            ax.bar(np.arange(len(names)) + i * width, ys, width, label=r.name)
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2)
        ax.set_xticklabels([n.split(":")[0] for n in names], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylim(bottom=0.5)
        ax.set_ylabel(f"shards fetched / S, {_cap(cfg.caches[0])}")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", which="both", lw=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- targets


def _noise(count: float) -> float:
    """Three standard deviations of a correlation of `count` independent pairs."""
    return 3.0 / math.sqrt(max(count, 1.0))


def targets(cfg: Config, runs: list[OrderRun], ref: OrderRun | None, scale: list[tuple[Config, list[OrderRun]]],
            quality_floor: float, match: float) -> list[str]:
    out: list[str] = []
    py1e = next((r for r in runs if r.name == "MosaicML py1e" and r.quality), None)
    refq = ref.quality if ref else {}
    crs = [r for r in runs if r.family == "croupier" and r.quality]
    if not crs or not refq:
        return ["- croupier's shard order was not run: no target judged."]
    floor = py1e.quality["distinct"] / refq["distinct"] if py1e else quality_floor
    floor_src = "py1e in this run" if py1e else f"{quality_floor} (MosaicML not run)"
    n_pairs = refq["steps"] * cfg.global_batch
    steady = cfg.scenarios[0].name
    cap = cfg.caches[0]

    def qualifies(r: OrderRun) -> tuple[bool, str]:
        q = r.quality
        a = q["distinct"] / refq["distinct"]
        why = [f"(a) {a:.3f}"]
        ok = a >= floor
        if py1e:
            rho_lim = max(abs(py1e.quality["rho"]), abs(refq["rho"])) + _noise(n_pairs)
            rin_lim = max(abs(py1e.quality["rho_in"]), abs(refq["rho_in"])) + _noise(n_pairs / cfg.shards) / math.sqrt(
                cfg.shards)
            c_g = q["classes_g"] >= py1e.quality["classes_g"]
            ok = ok and abs(q["rho"]) <= rho_lim and abs(q["rho_in"]) <= rin_lim and c_g
            why.append(f"|rho| {abs(q['rho']):.4f} (limit {rho_lim:.4f}), within-shard |rho| {abs(q['rho_in']):.4f} "
                       f"(limit {rin_lim:.4f}), classes per global batch {q['classes_g']:.1f} (py1e "
                       f"{py1e.quality['classes_g']:.1f}); per rank batch {q['classes_r']:.2f} (py1e "
                       f"{py1e.quality['classes_r']:.2f}, not judged)")
        return ok, ", ".join(why)

    out.append(f"Quality floor: (a) >= {floor:.3f} of the global permutation's ({floor_src})"
               + (", (b) no larger than py1e's or the global permutation's beyond 3 sigma of sampling noise, "
                  "(c) no fewer classes per global batch than py1e (the batch the optimizer steps on; the classes "
                  "per rank batch are shown, not judged)" if py1e else "") + ".")
    good = []
    for r in crs:
        ok, why = qualifies(r)
        if ok:
            good.append(r)
        out.append(f"- {r.name}: {'meets' if ok else 'misses'} the quality floor: {why}.")
    if not good:
        out.append("- **missed**: no shard-order setting run here reaches the quality floor.")
    for r in good:
        st = r.fetches[steady][cap]
        resizes = {s: r.fetches[s][cap] for s in r.fetches if s != steady}
        worst = max(resizes.values()) if resizes else float("nan")
        ok = st <= 1.05 and worst <= 1.25
        out.append(f"- {r.name}, {_cap(cap)}: steady {st:.3f} x S (target <= 1.05), worst resize or rollback "
                   f"{worst:.3f} x S (target <= 1.25): **{'met' if ok else 'missed'}**"
                   + ("" if ok else " (" + ", ".join(f"{k}: {v:.3f}" for k, v in resizes.items() if v > 1.25) + ")")
                   + ".")
        if "belady" in r.notes:
            out.append(f"  - steady under Belady's rule (each node evicts the shard its plan reads next furthest "
                       f"ahead): {r.notes['belady']} x S; no rule fetches fewer than the shards each node reads at "
                       f"all, {r.notes['floor']} x S (windows that two reader groups share are fetched by both).")
    for scfg, sruns in scale:
        for r in sruns:
            if r.family != "croupier":
                continue
            st = r.fetches.get(scfg.scenarios[0].name, {}).get(scfg.caches[0], float("nan"))
            worst = max((v[scfg.caches[0]] for k, v in r.fetches.items() if k != scfg.scenarios[0].name),
                        default=float("nan"))
            ok = st <= 1.05 and worst <= 1.25
            out.append(f"- scale, {scfg.n:,} samples in {scfg.shards:,} shards, {r.name}, {_cap(scfg.caches[0])}: "
                       f"steady {st:.3f} x S, worst of the resizes and the rollback {worst:.3f} x S: "
                       f"**{'met' if ok else 'missed'}** (quality of this setting: the table above, same settings at "
                       f"S = {cfg.shards:,}).")
    for r in runs:
        if r.family != "mosaic" or steady not in r.fetches:
            continue
        resizes = {k: v[cap] for k, v in r.fetches.items() if k != steady}
        out.append(f"- beside it, {r.name} ({r.settings}): (a) {r.quality['distinct'] / refq['distinct']:.3f}, steady "
                   f"{r.fetches[steady][cap]:.2f} x S, worst resize or rollback "
                   f"{max(resizes.values(), default=float('nan')):.2f} x S at {_cap(cap)} (its `relaxed` partition"
                   + (f"; {r.notes['orig']}" if "orig" in r.notes else "") + ").")
    matching = [r for r in crs if r.quality["distinct"] / refq["distinct"] >= match
                and r.quality["classes_g"] / refq["classes_g"] >= match]
    if matching:
        best = min(matching, key=lambda r: r.fetches[steady][cap])
        out.append(f"- The setting that matches the global permutation's quality ((a) and classes per global batch "
                   f">= {match} of its): {best.settings} ({best.name}), fetching {best.fetches[steady][cap]:.2f} x S "
                   f"in a steady epoch at {_cap(cap)} and "
                   f"{best.fetches[steady].get(UNBOUNDED, float('nan')):.2f} x S unbounded (global permutation: "
                   f"{ref.fetches[steady][cap] if ref else float('nan'):.2f} and "
                   f"{ref.fetches[steady].get(UNBOUNDED, float('nan')) if ref else float('nan'):.2f}).")
    else:
        out.append(f"- No setting run here reaches {match} of the global permutation's (a) and classes per global batch.")
    return out


# --------------------------------------------------------------------------- main


def _mem_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return float("nan")


def _describe(cfg: Config) -> str:
    return (f"S = {cfg.shards:,} shards of {cfg.shard_size:,} samples (N = {cfg.n:,}), {cfg.nodes} nodes x "
            f"{cfg.ranks_per_node} ranks, batch {cfg.batch} per rank (global {cfg.global_batch:,}), seed {cfg.seed}, "
            f"epoch {cfg.epoch}, caches: {', '.join(_cap(c) for c in cfg.caches)}")


def run_all(cfg: Config, peer_py: Path | None, work: Path, label: str) -> list[OrderRun]:
    runs: list[OrderRun] = []
    if cfg.global_perm:
        _log(f"{label}: croupier global permutation")
        runs.append(run_croupier(cfg, None))
    for w in cfg.windows:
        _log(f"{label}: croupier shards {w[0]} x {w[1]}")
        runs.append(run_croupier(cfg, w))
    if peer_py is not None:
        for algo in cfg.mosaic_algos:
            _log(f"{label}: MosaicML {algo}")
            runs.append(run_mosaic(cfg, algo, peer_py, work))
    if cfg.quality and cfg.hf_buffer:
        _log(f"{label}: HF-style buffer")
        runs.append(run_hf(cfg))
    for r in runs:
        _log(f"{label}: {r.name}: {r.seconds:.1f} s")
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, no MosaicML: checks that it works (seconds)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "bench", help="where shards.md and the plots go")
    parser.add_argument("--peer-env", type=Path, default=ROOT / "out" / "peers" / "mosaic",
                        help="MosaicML's environment (made on first use)")
    parser.add_argument("--mosaic", choices=("auto", "on", "off"), default="auto",
                        help="run MosaicML's orders (auto: not with --quick)")
    parser.add_argument("--no-scale", action="store_true", help="leave out item 4's scale run")
    parser.add_argument("--scale-n", type=float, default=1e9, help="samples of the scale run (default 1e9)")
    parser.add_argument("--mosaic-scale-n", type=float, default=1e8,
                        help="samples of MosaicML's scale run, same shard count (default 1e8)")
    parser.add_argument("--scale-algos", default="py1e,py1s", help="MosaicML algorithms of the scale run")
    parser.add_argument("--windows", default=None, help="croupier settings, shard_window x lanes: '8x16,32x16'")
    parser.add_argument("--orders", default=",".join(ORDER_FAMILIES),
                        help="the orders to run, of " + ",".join(ORDER_FAMILIES) + " (default all; mosaic also needs "
                             "--mosaic): a rerun of some rows")
    parser.add_argument("--belady", action="store_true",
                        help="also count the steady epoch's fetches of croupier's shard orders under Belady's rule")
    parser.add_argument("--no-main", action="store_true", help="leave out the main run (items 3 and 4's first part)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="processes the fetch simulation splits the nodes over (default 1)")
    parser.add_argument("--peer-request", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peer_request:
        return _peer_worker(args.peer_request)

    t_start = time.perf_counter()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    lib = _compile_lru(out / ".build")
    NodeCache.lib = lib
    if lib is not None:
        _check_lru()
    lru_method = ("exact per-access LRU in C (compiled at run time, checked against a Python LRU on random sequences)"
                  if lib is not None else "exact per-access LRU in Python (no C compiler found)")
    cfg = main_config(args.quick)
    if args.windows:
        cfg = replace(cfg, windows=tuple(tuple(int(v) for v in w.split("x")) for w in args.windows.split(",")))  # type: ignore[misc]
    picked = tuple(o for o in args.orders.split(",") if o)
    unknown = sorted(set(picked) - set(ORDER_FAMILIES))
    if unknown:
        parser.error(f"--orders {args.orders!r}: {unknown} are not orders of {','.join(ORDER_FAMILIES)}")

    def pick(c: Config) -> Config:
        return replace(c, jobs=args.jobs, global_perm="global" in picked, belady=args.belady,
                       windows=c.windows if "croupier" in picked else (),
                       mosaic_algos=c.mosaic_algos if "mosaic" in picked else (),
                       hf_buffer=c.hf_buffer if "hf" in picked else 0)

    cfg = pick(cfg)
    use_mosaic = "mosaic" in picked and (args.mosaic == "on" or (args.mosaic == "auto" and not args.quick))
    peer_py = ensure_peer_env(args.peer_env) if use_mosaic else None
    work = Path(tempfile.mkdtemp(prefix="shards_sim_", dir=out))
    try:
        runs = [] if args.no_main else run_all(cfg, peer_py, work, "main")
        ref = next((r for r in runs if r.family == "global"), None)
        scale: list[tuple[Config, list[OrderRun]]] = []
        if not args.no_scale and (lib is not None or args.quick):
            algos = tuple(a for a in args.scale_algos.split(",") if a)
            big, small = scale_configs(args.quick, int(args.scale_n), int(args.mosaic_scale_n), algos)
            big, small = pick(big), pick(small)
            scale.append((big, run_all(big, None, work, "scale")))
            scale.append((small, run_all(small, peer_py, work, "scale, MosaicML's N")))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    elapsed = time.perf_counter() - t_start

    lines = report(cfg, runs, ref, scale, args, lru_method, elapsed, peer_py is not None)
    text = "\n".join(lines) + "\n"
    (out / "shards.md").write_text(text)
    print(text)
    if ref is not None:
        plot(out / "shards.png", cfg, runs, ref, f"Shuffle quality against shard fetches\n{_describe(cfg)}")
    if scale:
        plot_scale(out / "shards_scale.png",
                   [(f"{c.n:,} samples in {c.shards:,} shards, {c.nodes} x {c.ranks_per_node} ranks", c, r) for c, r in scale])
    _log(f"wrote {out / 'shards.md'} ({elapsed:.0f} s)")
    return 0


def report(cfg: Config, runs: list[OrderRun], ref: OrderRun | None, scale: list[tuple[Config, list[OrderRun]]],
           args: argparse.Namespace, lru_method: str, elapsed: float, mosaic: bool) -> list[str]:
    import numpy

    versions = sorted({r.notes["version"] for s in [runs] + [x[1] for x in scale] for r in s if "version" in r.notes})
    cmd = "python benchmarks/shards_sim.py " + " ".join(a for a in sys.argv[1:])
    lines = [
        "# Shard-local orders: shuffle quality and shard fetches",
        "",
        f"`{cmd.strip()}` on {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, "
        f"numpy {numpy.__version__}; {elapsed / 60:.1f} minutes; {time.strftime('%Y-%m-%d')}.",
        "MosaicML: " + (", ".join(versions) if versions else "not run" + (" (--quick)" if args.quick else "")) + ".",
        "",
        "## Method",
        "",
        f"- Every order deals the same epoch ({_describe(cfg)}); a step is every rank's batch at that step "
        "(lockstep); a global batch is all ranks' step. Only complete global batches count for the quality figures.",
        "- (a) distinct shards per global batch, mean over the epoch's global batches; the uniform draw "
        "(croupier's global permutation) is the reference. (b) Spearman correlation between a sample's dataset index "
        "and its position in the epoch (0 for a uniform draw); within-shard: the Spearman correlation between a "
        "sample's row in its shard and its position in the epoch, per shard, averaged over shards (1 = rows read in "
        f"stored order). (c) {cfg.classes:,} classes, shard s holding class s x {cfg.classes:,} / S only (consecutive "
        "shards share a class, the worst case for reading in storage order): distinct classes per global batch and "
        "per rank batch.",
        f"- Fetches: every node has its own cache counted in shards, read in the order its ranks consume their "
        f"samples (step by step, rank by rank within a step, a batch's samples in order): {lru_method}. Two rules "
        "at the bounded size: \"done first\" is croupier's reader (`croupier.data`, `eviction=\"plan\"`): a shard "
        "whose every row of the epoch was read is evicted first (the plan needs it no more this epoch), the least "
        "recently used otherwise. The node counts the rows it reads; at every resize and resume (the processes "
        "restart) its count starts from the resume point, as `ShardedDataset.resume` seeds the reader's board: "
        "each shard's rows the epoch consumed before it (`croupier.core.shards.consumed_rows`), so a shard half read "
        "before a resize is \"done\" once the node reads its last rows after it. Orders other than croupier's shard "
        "order get no seed (their count starts at zero, as the reader's does). The "
        "other is plain LRU (MosaicML's cache evicts the least recently used shards). Every order is shown under "
        "both. A miss is a "
        "fetch; fetches / S is the shards fetched per epoch over the dataset's shards (all shards are the same size, "
        "so it is also the bytes fetched over the dataset's bytes). Node skew: the most fetches of one node over the "
        "mean per node (nodes that ever took part).",
        "- Scenarios: the base run starts the epoch on the base world. A resize resumes from the checkpoint at 40% "
        "of the epoch on the new node count (and grows back at 70%); a rollback runs to 50%, then resumes from the "
        "checkpoint taken at 30% on the same world. Nodes keep their cache and their number across a resize (node g "
        "stays node g); departed nodes' caches are gone, new nodes start empty. croupier resumes with "
        "`plan_epoch(spec, plan.advance(j), world, epoch)`; MosaicML with its own resumption: `get_partitions` with "
        "`drop_first` = the samples seen, the same canonical nodes and `initial_physical_nodes` = the first run's "
        "(its default partition algorithm `relaxed`, as `StreamingDataset` calls it, one worker per rank), the "
        "order `shuffle[ids]` of `get_shuffle` as its `random` batching applies it. Repeated / unseen: samples "
        "dealt more than once / never in the run's kept steps (the rolled-back steps not counted); croupier's "
        "`tail=\"drop\"` leaves the epoch's last partial global batch unseen by design.",
        f"- MosaicML runs in its own environment ({MOSAIC_PACKAGE} installed without its dependencies, numpy < 2.2): "
        "`streaming.base.shuffle.get_shuffle` and `streaming.base.partition.get_partitions` are imported with the "
        "packages above them stood in by empty modules (its `streaming/__init__` imports torch and torchvision); the "
        "indices come back through .npy files. Its canonical nodes: `StreamingDataset`'s defaults (64 x nodes for "
        "py1s and py2s, the nodes otherwise) unless said; block size its default, max(4,000,000 / canonical nodes, "
        "262,144).",
        f"- HF-style: the shards in a shuffled order dealt round robin to the ranks, each rank reading its shards' "
        f"rows in stored order through its own shuffle buffer of {cfg.hf_buffer:,} (`IterableDataset.shuffle`'s "
        "rule); a shard is fetched when its rank reads it. That is HF's split when the shard count divides the world "
        f"({cfg.shards:,} over {cfg.world} ranks " + ("does" if cfg.shards % cfg.world == 0 else
                                                      "does not: HF's own split would then have every rank read every "
                                                      "shard") + "). The epoch ends where the shortest rank's stream "
        "ends (ranks may hold one shard more than others), hence its unseen samples. It has no exact resume: only its "
        "steady epoch is counted.",
        "",
    ]
    lines += [f"## Shuffle quality (item 3): {_describe(cfg)}", ""]
    lines += quality_table(cfg, runs, ref)
    lines += ["", "Seconds per order (quality and every scenario): " + ", ".join(f"{r.name} {r.seconds:.0f}" for r in runs)
              + ".", "", "![quality against fetches](shards.png)", ""]
    for sc in cfg.scenarios:
        lines += [f"### Fetches: {sc.name}", ""]
        lines += fetch_table(cfg, runs, sc.name, ref)
        lines.append("")
    orig = [f"{r.name}: {r.notes['orig']}" for r in runs if "orig" in r.notes]
    if orig:
        lines += ["MosaicML's other partition algorithm, `orig`, refuses these resizes (asked in the same run):", ""]
        lines += [f"- {o}" for o in orig] + [""]
    for scfg, sruns in scale:
        lines += [f"## Fetches at scale (item 4): {_describe(scfg)}", ""]
        ms = [r for r in sruns if r.family == "mosaic" and "peak" in r.notes]
        if ms:
            peak = max(float(r.notes["peak"]) for r in ms)
            big_n = max(c.n for c, _ in scale)
            lines += [f"MosaicML's shuffle and partition are O(N) arrays of int64: run at N = {scfg.n:,} (the same "
                      f"{scfg.shards:,} shards, {scfg.shard_size:,} samples each), canonical nodes {scfg.mosaic_ncn}, "
                      f"with croupier beside it at the same N. Its process peaked at {peak:.1f} GiB of RSS here "
                      f"({peak * 2**30 / scfg.n:.0f} bytes a sample): about {peak * big_n / scfg.n:.0f} GiB at "
                      f"N = {big_n:,}, on a machine of {_mem_gib():.0f} GiB shared with other work.", ""]
        for sc in scfg.scenarios:
            lines += [f"### {sc.name}", ""]
            lines += fetch_table(scfg, sruns, sc.name, next((r for r in sruns if r.family == "global"), None))
            lines.append("")
        lines += ["Seconds per order: " + ", ".join(f"{r.name} {r.seconds:.0f}" for r in sruns) + ".", ""]
        orig = [f"{r.name}: {r.notes['orig']}" for r in sruns if "orig" in r.notes]
        lines += [f"- {o}" for o in orig] + ([""] if orig else [])
    if scale:
        lines += ["![fetches at scale](shards_scale.png)", ""]
    lines += ["## Targets", ""]
    lines += targets(cfg, runs, ref, scale, 0.83, 0.99)
    lines += ["", "Not measured here: the epoch start, memory per shard, position -> index and batch expansion targets "
              "(item 1's), and item 2's exactness tests.", ""]
    return lines


if __name__ == "__main__":
    sys.exit(main())
