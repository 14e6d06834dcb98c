"""Every rank of a world as sampler objects in one test process: they join together, then step in lockstep."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_END = object()


class Ranks:
    """Iterators over W samplers (rank r is ``samplers[r]``) that a test advances one step at a time.

    A generation starts only once all its ranks have joined, and a sampler joins on its first
    ``next()``; so the first item of every rank is fetched concurrently, each in its own thread,
    and the others are fetched in the calling thread.
    """

    def __init__(self, samplers: Sequence[Any]) -> None:
        self.samplers = list(samplers)
        self.iters: list[Iterator[Any]] = [iter(s) for s in self.samplers]
        with ThreadPoolExecutor(max_workers=max(1, len(self.iters))) as pool:
            self._first: list[Any] = list(pool.map(lambda it: next(it, _END), self.iters))

    def next(self, rank: int) -> Any | None:
        """Rank's next item (an index, or a batch for a batch sampler); None at the end of its epoch."""
        if self._first[rank] is not None:
            item, self._first[rank] = self._first[rank], None
        else:
            item = next(self.iters[rank], _END)
        return None if item is _END else item

    def new_iterators(self) -> None:
        """Fresh iterators on every rank (the next epoch, or a loop that starts over); no join needed."""
        self.iters = [iter(s) for s in self.samplers]
        self._first = [None] * len(self.iters)

    def close(self) -> None:
        for s in self.samplers:
            s.close()


def on_ranks(world: int, fn: Callable[[int], Any]) -> list[Any]:
    """Runs fn(rank) for every rank in its own thread (the ranks of one generation join together)."""
    out: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as e:  # re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return out
