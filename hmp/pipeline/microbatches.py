"""The micro-batch order (GPipe-style fill and drain per step), identical on every worker.

Each step's batch is cut into ``micro_batches`` micro-batches that stage 0 sends forward back to
back so the stages work on different ones at once; a stage pushes to the PS once all of its
micro-batches have gone backward; micro-batch ``m`` of a stage with ``k`` workers goes to worker
``m % k``. Which examples make up a micro-batch is a pure function of (step, micro-batch), so no
example ids travel. See docs/pipeline.md, "A step".
"""

from __future__ import annotations

import torch

from hmp.data import ShuffledBatches


def worker_for(micro_batch: int, workers: int) -> int:
    """Index (within its stage) of the worker that handles ``micro_batch``."""
    return micro_batch % workers


def micro_batches_of(index: int, workers: int, micro_batches: int) -> tuple[int, ...]:
    """The micro-batches worker ``index`` of a ``workers``-wide stage handles in every step."""
    return tuple(m for m in range(micro_batches) if worker_for(m, workers) == index)


def steps_per_epoch(n_train: int, batch_size: int) -> int:
    if n_train < batch_size:
        raise ValueError(f"{n_train} training examples are fewer than one batch of {batch_size}")
    return n_train // batch_size  # the ragged tail of each epoch is dropped


def total_steps(epochs: int, n_train: int, batch_size: int) -> int:
    return epochs * steps_per_epoch(n_train, batch_size)


class ExampleOrder:
    """Example ids of (step, micro-batch), cut from the seeded epoch orders of :class:`ShuffledBatches`."""

    def __init__(self, n_train: int, batch_size: int, micro_batches: int, seed: int) -> None:
        if batch_size % micro_batches:
            raise ValueError(f"batch size {batch_size} is not a multiple of {micro_batches} micro-batches")
        self.n, self.batch, self.mb, self.seed = n_train, batch_size, micro_batches, seed
        self.per_epoch = steps_per_epoch(n_train, batch_size)
        self._shuffled = ShuffledBatches(n_train, seed=seed)

    @property
    def micro_batch_size(self) -> int:
        return self.batch // self.mb

    def epoch_of(self, step: int) -> int:
        return step // self.per_epoch

    def ids(self, step: int, micro_batch: int) -> torch.Tensor:
        lo = (step % self.per_epoch) * self.batch + micro_batch * self.micro_batch_size
        return self._shuffled.order(self.epoch_of(step))[lo:lo + self.micro_batch_size]
