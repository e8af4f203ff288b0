"""A keyed permutation of ``[0, n)`` computed per index: no array of ``n`` indices is built.

A balanced Feistel network over ``2 * h`` bits (``4**h >= n``) is a bijection of ``[0, 4**h)``;
cycle-walking (apply it again while the result is ``>= n``) restricts it to a bijection of
``[0, n)`` (Black and Rogaway, "Ciphers with arbitrary finite domains", 2002; Grain's
``index_shuffle`` does the same). Since ``4**h < 4 * n``, a walk takes fewer than 4 rounds on average.

The round function is splitmix64 of the right half xor a round key; the keys come from
blake2b of ``(seed, epoch)``, so every epoch of every seed has its own order.
"""

from __future__ import annotations

import hashlib

import numpy as np

ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


class FeistelPermutation:
    """A bijection ``perm`` of ``[0, n)`` keyed by ``(seed, epoch)``.

    ``perm(i)`` takes an int64 array (any shape) of indices in ``[0, n)`` and returns an int64
    array of the same shape; ``perm(i) == perm(j)`` only when ``i == j``.

    Raises:
        ValueError: ``n < 1`` or ``n > 2**62``.
    """

    def __init__(self, n: int, seed: int, epoch: int):
        if not 1 <= n <= 2**62:
            raise ValueError(f"permutation size {n} not in [1, 2**62]")
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        digest = hashlib.blake2b(f"ray-diloco/{int(seed)}/{int(epoch)}".encode(), digest_size=8 * ROUNDS).digest()
        self.keys = np.frombuffer(digest, dtype="<u8").astype(np.uint64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << h) | right

    def __call__(self, index: np.ndarray | int) -> np.ndarray:
        i = np.asarray(index, dtype=np.int64)
        if i.size and (i.min() < 0 or i.max() >= self.n):
            raise IndexError(f"index out of [0, {self.n})")
        x = self._encrypt(i.astype(np.uint64))
        out = x >= np.uint64(self.n)
        while out.any():  # cycle-walking
            x[out] = self._encrypt(x[out])
            out = x >= np.uint64(self.n)
        return x.astype(np.int64)
