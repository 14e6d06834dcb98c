"""Packing documents into rows of `seq_len` tokens: pieces, the planners (greedy, best-fit) and a batch's tensors."""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Sequence
from typing import Protocol

import torch

from croupier.core.checks import check_int

#: What a document longer than a row becomes: its pieces of at most ``seq_len`` tokens, each
#: packed as a document of its own ("split"), or its first ``seq_len`` tokens ("truncate").
LONG = ("split", "truncate")


@dataclasses.dataclass(frozen=True)
class Piece:
    """A run of one document's tokens that goes into a row whole.

    Attributes:
        index: The document's dataset index.
        offset: Where the run starts in the document, in tokens.
        length: Its tokens, at most the row's ``seq_len``.
        tokens: The tokens themselves (a 1-D ``int64`` tensor of `length`); None where only the
            lengths matter (a plan).
    """

    index: int
    offset: int
    length: int
    tokens: torch.Tensor | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def key(self) -> tuple[int, int, int]:
        """``(index, offset, length)``: what a row names and a checkpoint keeps of the piece."""
        return (self.index, self.offset, self.length)


def pieces_of(index: int, doc: torch.Tensor | int, seq_len: int, long: str) -> list[Piece]:
    """A loaded document's pieces, in order: itself when it fits a row, else cut as `long` says.

    Args:
        index: The document's dataset index.
        doc: Its tokens (a 1-D tensor), or its length alone (the pieces then carry no tokens).
        seq_len: Tokens per row.
        long: ``"split"``: pieces of `seq_len` tokens from the start, the last one shorter;
            ``"truncate"``: the first `seq_len` tokens, the rest is not trained.
    """
    n = doc if isinstance(doc, int) else int(doc.shape[0])
    if n <= seq_len:
        return [_piece(index, doc, 0, n)]
    if long == "truncate":
        return [_piece(index, doc, 0, seq_len)]
    return [_piece(index, doc, a, min(seq_len, n - a)) for a in range(0, n, seq_len)]


def _piece(index: int, doc: torch.Tensor | int, offset: int, length: int) -> Piece:
    return Piece(index, offset, length, None if isinstance(doc, int) else doc[offset:offset + length])


Row = tuple[Piece, ...]


class Planner(Protocol):
    """A packing policy: pieces come in one at a time; complete rows go out in the order they close.

    A piece is either waiting (returned by :meth:`waiting`) or in exactly one row returned by
    :meth:`add` or :meth:`flush`: the planner MUST NOT drop, copy or cut one, and a row's pieces
    MUST add up to at most ``seq_len`` tokens.
    """

    def add(self, piece: Piece) -> list[Row]:
        """Takes `piece` (at most ``seq_len`` tokens); returns the rows it completed (often none)."""

    def flush(self) -> list[Row]:
        """Every waiting piece, in rows: the last rows of an epoch."""

    def waiting(self) -> list[Piece]:
        """The pieces held, not yet in a returned row, oldest first."""


class Greedy:
    """Next-fit: pieces go into the open row in the order they come; one that does not fit closes it.

    Args:
        seq_len: Tokens per row.
    """

    def __init__(self, seq_len: int) -> None:
        self._seq_len = seq_len
        self._open: list[Piece] = []
        self._used = 0

    def add(self, piece: Piece) -> list[Row]:
        out: list[Row] = []
        if self._used + piece.length > self._seq_len:
            out.append(tuple(self._open))
            self._open, self._used = [], 0
        self._open.append(piece)
        self._used += piece.length
        if self._used == self._seq_len:
            out.append(tuple(self._open))
            self._open, self._used = [], 0
        return out

    def flush(self) -> list[Row]:
        out = [tuple(self._open)] if self._open else []
        self._open, self._used = [], 0
        return out

    def waiting(self) -> list[Piece]:
        return list(self._open)


class BestFit:
    """Best-fit within a bounded buffer: once `buffer` pieces wait, a row is made of the oldest one,
    then again and again of the longest waiting piece that still fits.

    NOTE: the oldest piece opens every row, so no piece waits for more than `buffer` rows: the
    rows come out in about the order of the data, and a checkpoint holds at most `buffer` pieces.

    Args:
        seq_len: Tokens per row.
        buffer: Pieces held before a row is made.
    """

    def __init__(self, seq_len: int, buffer: int) -> None:
        self._seq_len, self._buffer = seq_len, buffer
        self._pool: dict[int, Piece] = {}  # arrival number -> piece, oldest first
        self._by_length: list[tuple[int, int]] = []  # (length, -arrival), sorted: the oldest of a length last
        self._arrivals = itertools.count()

    def add(self, piece: Piece) -> list[Row]:
        n = next(self._arrivals)
        self._pool[n] = piece
        bisect.insort(self._by_length, (piece.length, -n))
        out: list[Row] = []
        while len(self._pool) >= self._buffer:
            out.append(self._row())
        return out

    def flush(self) -> list[Row]:
        out: list[Row] = []
        while self._pool:
            out.append(self._row())
        return out

    def waiting(self) -> list[Piece]:
        return list(self._pool.values())

    def _row(self) -> Row:
        first = next(iter(self._pool))
        row = [self._take(first)]
        room = self._seq_len - row[0].length
        while room > 0 and self._by_length:
            i = bisect.bisect_right(self._by_length, (room, 0)) - 1  # the longest piece of at most `room` tokens
            if i < 0:
                break
            length, neg = self._by_length[i]
            row.append(self._take(-neg))
            room -= length
        return tuple(row)

    def _take(self, n: int) -> Piece:
        piece = self._pool.pop(n)
        del self._by_length[bisect.bisect_left(self._by_length, (piece.length, -n))]
        return piece


#: The planners by name (``PackedLoader(pack=...)``).
PLANNERS = ("greedy", "best_fit")


def make_planner(pack: str, seq_len: int, buffer: int) -> Planner:
    """The planner named `pack` for rows of `seq_len` tokens (`buffer` pieces held by ``"best_fit"``).

    Raises:
        ValueError: an unknown `pack`, or a `seq_len` or `buffer` below 1.
        TypeError: `seq_len` or `buffer` is not an int.
    """
    check_int("seq_len", seq_len, 1)
    check_int("buffer", buffer, 1)
    if pack == "greedy":
        return Greedy(seq_len)
    if pack == "best_fit":
        return BestFit(seq_len, buffer)
    raise ValueError(f"pack must be one of {PLANNERS} (got pack={pack!r})")


@dataclasses.dataclass(frozen=True)
class Packed:
    """Rows of packed documents, as flash-attention's varlen kernels and torchtitan's document masks read them.

    Attributes:
        tokens: ``(rows, seq_len)`` int64: each row's pieces one after the other, then `pad_id`.
        position_ids: ``(rows, seq_len)`` int64: each piece's positions in its document (they
            restart at 0 for each document; a piece that continues a split document goes on from
            its offset), and 0, 1, ... over a row's padding.
        cu_seqlens: ``(segments + 1,)`` int32: where each piece starts in the flattened batch
            (``tokens.view(-1)``), a row's padding being a segment of its own, and the total
            (``rows * seq_len``) last.
        max_seqlen: The longest segment.
        pieces: Per row, its pieces as ``(dataset index, token offset, length)``.
        padding: Pad tokens in the batch.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    pieces: tuple[tuple[tuple[int, int, int], ...], ...]
    padding: int

    def __len__(self) -> int:
        """Rows in the batch."""
        return int(self.tokens.shape[0])


def assemble(rows: Sequence[Row], seq_len: int, pad_id: int) -> Packed:
    """The tensors of `rows` (each piece carrying its tokens), padded to `seq_len` with `pad_id`."""
    tokens = torch.full((len(rows), seq_len), pad_id, dtype=torch.int64)  # (rows, seq_len)
    positions = torch.zeros((len(rows), seq_len), dtype=torch.int64)  # (rows, seq_len)
    bounds = [0]
    padding = 0
    for r, row in enumerate(rows):
        at = 0
        for p in row:
            assert p.tokens is not None, "a piece to assemble carries its tokens"
            tokens[r, at:at + p.length] = p.tokens
            positions[r, at:at + p.length] = torch.arange(p.offset, p.offset + p.length)
            at += p.length
            bounds.append(r * seq_len + at)
        if at < seq_len:
            positions[r, at:] = torch.arange(seq_len - at)
            padding += seq_len - at
            bounds.append((r + 1) * seq_len)
    cu = torch.tensor(bounds, dtype=torch.int32)
    longest = int((cu[1:] - cu[:-1]).max()) if len(bounds) > 1 else 0
    return Packed(tokens, positions, cu, longest, tuple(tuple(p.key for p in row) for row in rows), padding)
