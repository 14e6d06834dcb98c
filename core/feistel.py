"""A keyed, stateless bijection on [0, n) for any n in [1, 2**62]: Feistel rounds plus cycle-walking."""

from __future__ import annotations

import functools
import hashlib
import struct
from typing import Any

import numpy as np

ROUNDS = 6

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def derive_key(*parts: int) -> int:
    """A 64-bit key from a tuple of non-negative ints (seed, epoch, window, ...), stable everywhere."""
    blob = b"".join(struct.pack("<Q", p & 0xFFFFFFFFFFFFFFFF) + struct.pack("<Q", p >> 64) for p in parts)
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8, person=b"croupier-key").digest(), "little")


@functools.lru_cache(maxsize=4096)
def round_keys(key: int) -> np.ndarray:
    """The ROUNDS round keys derived from one 64-bit key, as a read-only uint64 array of shape (ROUNDS,)."""
    keys = np.array([derive_key(key, i) for i in range(ROUNDS)], dtype=np.uint64)
    keys.flags.writeable = False  # shared by every caller through the cache
    return keys


def _domain_bits(n: int) -> int:
    # The smallest power-of-two domain holding [0, n), at least 2 bits so both halves exist.
    return max(2, (n - 1).bit_length())


def _encrypt(x: np.ndarray, bits: int, keys: np.ndarray) -> np.ndarray:
    """One pass of the Feistel network on [0, 2**bits), in place on the uint64 array `x` (returned);
    keys is (ROUNDS,) or (ROUNDS, len(x))."""
    # NOTE: an unbalanced network whose halves swap widths each round, so any bit count works
    # and the power-of-two domain is < 2n: cycle-walking takes fewer than 2 passes on average.
    # Every step writes into one of three buffers: no temporaries, so a large input costs no
    # allocation (and no page faults) per step, and numpy runs each step without the GIL.
    lo, z, t = np.empty_like(x), np.empty_like(x), np.empty_like(x)
    lo_bits = bits // 2
    for i in range(ROUNDS):
        hi_bits = bits - lo_bits
        np.bitwise_and(x, np.uint64((1 << lo_bits) - 1), out=lo)
        np.right_shift(x, np.uint64(lo_bits), out=x)  # x is now the high part
        # z = F(lo): splitmix64's finaliser of lo ^ key, cut to hi_bits
        np.bitwise_xor(lo, keys[i], out=z)
        np.right_shift(z, _S30, out=t)
        np.bitwise_xor(z, t, out=z)
        np.multiply(z, _M1, out=z)
        np.right_shift(z, _S27, out=t)
        np.bitwise_xor(z, t, out=z)
        np.multiply(z, _M2, out=z)
        np.right_shift(z, _S31, out=t)
        np.bitwise_xor(z, t, out=z)
        np.bitwise_and(z, np.uint64((1 << hi_bits) - 1), out=z)
        # (hi, lo) -> (lo, hi ^ F(lo)): lo becomes the high part, the new low part has hi_bits.
        np.bitwise_xor(x, z, out=x)
        np.left_shift(lo, np.uint64(hi_bits), out=lo)
        np.bitwise_or(x, lo, out=x)
        lo_bits = hi_bits
    return x


_MASK64 = (1 << 64) - 1
_M1_INT, _M2_INT = int(_M1), int(_M2)
#: Inputs up to this size take the scalar path: numpy's per-call cost is larger than the work.
SMALL = 16


@functools.lru_cache(maxsize=64)
def _schedule(bits: int) -> tuple[tuple[int, int, int, int], ...]:
    """Each round's (low width, high width, low mask, high mask) on [0, 2**bits), as :func:`_encrypt` walks them."""
    out = []
    lo_bits = bits // 2
    for _ in range(ROUNDS):
        hi_bits = bits - lo_bits
        out.append((lo_bits, hi_bits, (1 << lo_bits) - 1, (1 << hi_bits) - 1))
        lo_bits = hi_bits
    return tuple(out)


def rounds(n: int, keys: tuple[int, ...]) -> tuple[tuple[tuple[int, int, int, int], int], ...]:
    """What :func:`walk_one` takes for the domain [0, n): each round's widths, masks and key."""
    return tuple(zip(_schedule(_domain_bits(n)), keys))


def _permute_one(x: int, n: int, bits: int, keys: tuple[int, ...]) -> int:
    """The same bijection as :func:`permute`, on one Python int (for tiny inputs): passes of the network
    from `x` until one lands in [0, n) (so `x` may also be a value part way through the walk)."""
    return walk_one(x, n, tuple(zip(_schedule(bits), keys)))


def walk_one(x: int, n: int, steps: tuple[tuple[tuple[int, int, int, int], int], ...],
             mix: tuple[int, int] | None = None) -> int:
    """:func:`_permute_one` with its rounds made (`steps`, from :func:`rounds`): a caller that keeps them per
    key saves their making. `mix`: the mixing constants (the scalar rounds' own when None)."""
    m1, m2 = (_M1_INT, _M2_INT) if mix is None else mix
    while True:
        for (lo_bits, hi_bits, lo_mask, hi_mask), k in steps:
            lo = x & lo_mask
            z = lo ^ k
            z = ((z ^ (z >> 30)) * m1) & _MASK64
            z = ((z ^ (z >> 27)) * m2) & _MASK64
            x = (lo << hi_bits) | ((x >> lo_bits) ^ ((z ^ (z >> 31)) & hi_mask))
        if x < n:
            return x


def permute(positions: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """Maps positions in [0, n) to indices in [0, n) by a keyed bijection.

    Args:
        positions: Integer array of positions, each in [0, n).
        n: Domain size, 1 <= n <= 2**62.
        keys: Round keys from :func:`round_keys`, shape (ROUNDS,), or (ROUNDS, len(positions))
            to give every element its own key (used for per-window shuffles).

    Returns:
        int64 array of the same shape: the permuted indices.
    """
    if n == 1:
        return np.zeros(np.shape(positions), dtype=np.int64)
    bits = _domain_bits(n)
    if np.size(positions) <= SMALL:
        flat = np.asarray(positions, dtype=np.int64).reshape(-1)
        if keys.ndim == 1:
            ks = tuple(int(k) for k in keys)
            small = [_permute_one(int(p), n, bits, ks) for p in flat]
        else:
            small = [_permute_one(int(p), n, bits, tuple(int(k) for k in keys[:, i])) for i, p in enumerate(flat)]
        return np.array(small, dtype=np.int64).reshape(np.shape(positions))
    x = np.asarray(positions).astype(np.uint64, copy=True)
    return _walk(_encrypt, x, n, bits, keys, one=True)


def _walk(step: Any, x: np.ndarray, n: int, bits: int, keys: np.ndarray, one: bool = False) -> np.ndarray:
    """`step` (one pass of the network, or of its inverse) applied to `x`, then again to every element
    outside [0, n) until none is: the cycle-walk from a value in [0, n) always returns to [0, n), so
    this is still a bijection on it. `one`: the last few elements of a forward walk are finished by
    :func:`walk_one` (a pass of numpy calls costs as much on 2 elements as on 64).
    Returns int64.

    NOTE: the walk's last steps in plain Python take the vectorised rounds' constants (``_M1``,
    ``_M2``), so that they are one network with its first passes whatever those constants are.
    """
    un = np.uint64(n)
    x = step(x, bits, keys)
    out = x >= un
    while out.any():
        idx = np.flatnonzero(out)
        if one and idx.size <= SMALL:
            own = keys[:, idx].T.tolist() if keys.ndim == 2 else [keys.tolist()] * idx.size  # each one's round keys
            sched, mix = _schedule(bits), (int(_M1), int(_M2))
            for i, k, v in zip(idx.tolist(), own, x[idx].tolist()):
                x[i] = walk_one(v, n, tuple(zip(sched, k)), mix)
            break
        sub_keys = keys if keys.ndim == 1 else keys[:, idx]
        x[idx] = step(x[idx], bits, sub_keys)
        out[idx] = x[idx] >= un
    return x.astype(np.int64)


def _decrypt(x: np.ndarray, bits: int, keys: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_encrypt`: its rounds undone in reverse, in place on the uint64 array `x` (returned)."""
    widths = []  # (lo_bits, hi_bits) of each round, as _encrypt walks them
    lo_bits = bits // 2
    for _ in range(ROUNDS):
        widths.append((lo_bits, bits - lo_bits))
        lo_bits = bits - lo_bits
    for i in reversed(range(ROUNDS)):
        lo_bits, hi_bits = widths[i]
        # The round made x = (lo << hi_bits) | (hi ^ F(lo)): lo is the high part, F(lo) recomputed from it.
        lo = x >> np.uint64(hi_bits)
        z = lo ^ keys[i]
        with np.errstate(over="ignore"):
            z = (z ^ (z >> _S30)) * _M1
            z = (z ^ (z >> _S27)) * _M2
        z = (z ^ (z >> _S31)) & np.uint64((1 << hi_bits) - 1)
        hi = (x & np.uint64((1 << hi_bits) - 1)) ^ z
        x = (hi << np.uint64(lo_bits)) | lo
    return x


def unpermute(indices: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """The inverse of :func:`permute`: the position of each index in [0, n) under the same keys.

    Args:
        indices: Integer array of indices, each in [0, n).
        n: Domain size, 1 <= n <= 2**62.
        keys: The round keys given to :func:`permute`, shape (ROUNDS,) or (ROUNDS, len(indices)).

    Returns:
        int64 array of the same shape: ``permute(unpermute(i)) == i``.
    """
    if n == 1:
        return np.zeros(np.shape(indices), dtype=np.int64)
    bits = _domain_bits(n)
    x = np.asarray(indices).astype(np.uint64, copy=True).reshape(-1)
    return _walk(_decrypt, x, n, bits, keys).reshape(np.shape(indices))  # the cycle walked backwards
