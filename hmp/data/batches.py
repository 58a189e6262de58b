"""A worker's part of the training set (:func:`shard`) and :class:`ShuffledBatches`, the one seeded example order of
hmp (a worker's batches, a Hogbatch work unit, a pipeline micro-batch, a Hogwild thread's batches): deterministic
from a seed and the epoch, with a batch size that may change between batches (the scheduler resizes them)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor


def shard(x: Tensor, y: Tensor, index: int, count: int) -> tuple[Tensor, Tensor]:
    """Worker ``index`` of ``count``'s contiguous slice of ``(x, y)``: views, not copies.

    Sizes differ by at most one row (the first ``N % count`` shards get the extra row).
    The slice is contiguous, so shuffle before sharding if rows are ordered (every loader
    here returns a shuffled training set).
    """
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"shard count must be a positive int, got {count!r}")
    if not isinstance(index, int) or not 0 <= index < count:
        raise ValueError(f"shard index must be in [0, {count}), got {index!r}")
    if len(x) != len(y):
        raise ValueError(f"x and y differ in length: {len(x)} vs {len(y)}")
    base, extra = divmod(len(x), count)
    start = index * base + min(index, extra)
    stop = start + base + (1 if index < extra else 0)
    return x[start:stop], y[start:stop]


class ShuffledBatches:
    """Index batches over shuffled epochs of ``n`` examples: the one seeded example order of hmp.

    Epoch ``e`` visits ``range(n)`` once, in the order :meth:`order` ``(e)``: a permutation fixed by
    ``(seed, e)`` (numpy's SeedSequence mixes them into independent, platform-stable streams; ``seed``
    may be a tuple, e.g. ``(data_seed, worker_index)``), so every node and every restart derives the
    same order and no example ids need to travel. Iterating yields int64 index tensors of
    ``batch_size`` rows in that order (gather with ``x[idx]``); ``batch_size`` may be set between
    batches. The last batch of an epoch is shorter rather than spilling into the next. Iteration
    starts at ``epoch`` and stops after ``epochs`` epochs (None: never).
    """

    def __init__(self, n: int, batch_size: int = 1, seed: int | Sequence[int] = 0, *, epoch: int = 0,
                 epochs: int | None = None) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"cannot shuffle {n!r} examples; expected an int >= 1")
        if epochs is not None and epochs < 0:
            raise ValueError(f"epochs must be >= 0 or None, got {epochs!r}")
        self.n = n
        self.seed = (seed,) if isinstance(seed, (int, np.integer)) else tuple(seed)
        self.batch_size = batch_size
        self._epoch, self._end = epoch, None if epochs is None else epoch + epochs
        self._pos = 0
        self._cached: tuple[int, Tensor] | None = None

    @property
    def batch_size(self) -> int:
        """Rows in each following batch."""
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"batch_size must be a positive int, got {value!r}")
        self._batch_size = value

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    def order(self, epoch: int) -> Tensor:
        """Epoch ``epoch``'s permutation of ``range(n)`` (int64; the last one asked for is cached)."""
        if self._cached is None or self._cached[0] != epoch:
            perm = np.random.default_rng([*self.seed, epoch]).permutation(self.n)
            self._cached = (epoch, torch.from_numpy(perm))
        return self._cached[1]

    def __iter__(self) -> Iterator[Tensor]:
        return self

    def __next__(self) -> Tensor:
        if self._pos >= self.n:
            self._epoch, self._pos = self._epoch + 1, 0
        if self._end is not None and self._epoch >= self._end:
            raise StopIteration
        idx = self.order(self._epoch)[self._pos:self._pos + self._batch_size]
        self._pos += len(idx)
        return idx

    def next_batch(self, batch_size: int | None = None) -> Tensor | None:
        """The next batch, first switching to ``batch_size`` if given; None once ``epochs`` are used up."""
        if batch_size is not None:
            self.batch_size = batch_size
        return next(self, None)
