"""Hogwild-style CPU training: several Python threads update one shared model without locks.

Each thread takes the next mini-batch from a shared cursor (the only lock on the training path),
computes its own gradients with ``torch.autograd.grad`` and subtracts ``lr * grad`` from the shared
parameters in place; torch releases the GIL inside its ops, so the threads compute on different
cores at once. Why the unlocked races are acceptable is in docs/hogbatch.md, "Thread safety: why the races are acceptable".
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from hmp.data import ShuffledBatches


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: ``(model, x, y) -> batch-mean loss``, e.g. :meth:`hmp.train.task.Task.loss`
StepLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


# ----------------------------------------------------------------------------- results

@dataclasses.dataclass(frozen=True, slots=True)
class ThreadStats:
    """One thread's share of a run. ``busy_s``: wall seconds inside gather, forward, backward
    and update; ``cpu_s``: CPU seconds the thread itself consumed there (``time.thread_time``;
    exact with intra-op threads = 1, where an op runs entirely on the calling thread);
    ``loss_sum``: sum of the batch-mean losses it saw."""

    thread: int
    updates: int
    samples: int
    busy_s: float
    cpu_s: float
    loss_sum: float


@dataclasses.dataclass(frozen=True, slots=True)
class HogwildStats:
    """Outcome of :meth:`HogwildTrainer.run`; ``wall_s`` is seconds from the first thread's
    start to the last thread's end."""

    threads: tuple[ThreadStats, ...]
    wall_s: float
    batch_size: int

    @property
    def updates(self) -> int:
        return sum(t.updates for t in self.threads)

    @property
    def samples(self) -> int:
        return sum(t.samples for t in self.threads)

    @property
    def busy_s(self) -> float:
        return sum(t.busy_s for t in self.threads)

    @property
    def cpu_s(self) -> float:
        return sum(t.cpu_s for t in self.threads)

    @property
    def mean_loss(self) -> float:
        """Mean of the batch losses over all updates (nan when there were none)."""
        return sum(t.loss_sum for t in self.threads) / self.updates if self.updates else math.nan

    @property
    def updates_per_s(self) -> float:
        return self.updates / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def parallelism(self) -> float:
        """CPU seconds of all threads per wall second: above 1 only if threads ran at once."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def busy_fraction(self) -> float:
        """Share of the threads' wall time spent computing, in [0, 1]."""
        span = self.wall_s * len(self.threads)
        return min(1.0, self.busy_s / span) if span > 0 else 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class AccumulatedGradient:
    """What :meth:`GradientAccumulator.drain` hands over. ``grad_sum``: ``[P]`` float32, the
    sum over ``updates`` of each update's batch-mean gradient, flattened in
    ``model.parameters()`` order (trainable parameters only); so ``-lr * grad_sum`` is the step the local replica took
    and ``grad_sum / updates`` the mean gradient. ``samples``: examples behind it."""

    grad_sum: torch.Tensor
    samples: int
    updates: int


class GradientAccumulator:
    """A locked flat gradient sum that Hogwild threads add to and a worker drains to push.

    ``numel``: total parameter count P; the buffer is ``[P]`` on ``device`` in ``dtype``.
    """

    def __init__(self, numel: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if not isinstance(numel, int) or numel < 1:
            raise ValueError(f"numel must be an int >= 1, got {numel!r}")
        self.numel, self.device, self.dtype = numel, torch.device(device), dtype
        self._lock = threading.Lock()
        self._sum = torch.zeros(numel, device=self.device, dtype=dtype)
        self._samples = 0
        self._updates = 0

    @classmethod
    def for_model(cls, model: nn.Module) -> GradientAccumulator:
        """An accumulator sized and placed like ``model``'s trainable parameters (the ones a
        :class:`HogwildTrainer` updates)."""
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("model has no trainable parameters to accumulate gradients for")
        return cls(sum(p.numel() for p in params), params[0].device, params[0].dtype)

    def add(self, grads: Sequence[torch.Tensor], samples: int) -> None:
        """Add one update's gradients (one tensor per parameter, in order) from ``samples``
        examples."""
        flat = torch.cat([g.reshape(-1) for g in grads])  # outside the lock: the expensive part
        if flat.numel() != self.numel:
            raise ValueError(f"gradients hold {flat.numel()} values, the accumulator expects {self.numel}")
        with self._lock:
            self._sum.add_(flat.to(self._sum.dtype))
            self._samples += samples
            self._updates += 1

    def drain(self) -> AccumulatedGradient:
        """Take everything added so far and start again from zero (atomic w.r.t. ``add``)."""
        fresh = torch.zeros_like(self._sum)
        with self._lock:
            out = AccumulatedGradient(self._sum, self._samples, self._updates)
            self._sum, self._samples, self._updates = fresh, 0, 0
        return out

    @property
    def pending_samples(self) -> int:
        """Examples added since the last drain."""
        with self._lock:
            return self._samples


# ----------------------------------------------------------------------------- trainer

class _Cursor:
    """First-come-first-served batches of :class:`hmp.data.ShuffledBatches`, behind one lock.
    Stops handing out batches at the first of: ``epochs`` passes, ``max_updates`` batches,
    the ``deadline`` (``time.perf_counter`` seconds), or ``stop`` being set."""

    def __init__(self, n: int, epochs: int | None, max_updates: int | None, deadline: float | None,
                 seed: int, stop: threading.Event) -> None:
        self._lock = threading.Lock()
        self._batches = ShuffledBatches(n, seed=seed, epochs=epochs)
        self._max_updates, self._deadline, self._stop = max_updates, deadline, stop
        self._handed = 0

    def take(self, batch: int) -> torch.Tensor | None:
        with self._lock:
            if self._stop.is_set() or (self._max_updates is not None and self._handed >= self._max_updates):
                return None
            if self._deadline is not None and time.perf_counter() >= self._deadline:
                return None
            idx = self._batches.next_batch(batch)  # the epoch's last batch may be short; None after `epochs`
            self._handed += idx is not None
            return idx


class HogwildTrainer:
    """Lock-free multi-threaded SGD on one shared ``model`` (see the module docstring).

    ``threads``: Python threads doing updates; ``lr``: SGD step size; ``batch_size``: examples
    per update per thread (settable between and during runs: threads read it per batch);
    ``loss_fn(output, target)`` must return the batch-mean loss as a scalar tensor; or, instead of it,
    ``step(model, x, y)`` the batch-mean loss of a whole step (the job's task, :mod:`hmp.train.task`).
    Batches are moved to the device of the model's first parameter. Each thread's ops use the
    process's intra-op thread count, which this class never changes (it is process-wide and
    racy to change while threads run): a daemon sets it once at start (``[[nodes]] threads``,
    default 1, which lets each Hogwild thread own one core).
    """

    def __init__(self, model: nn.Module, threads: int, lr: float, batch_size: int, loss_fn: LossFn | None = None,
                 *, step: StepLoss | None = None) -> None:
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
            raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
        if (loss_fn is None) == (step is None):
            raise ValueError("give exactly one of loss_fn (output, target) and step (model, x, y)")
        fn = loss_fn if step is None else step
        if not callable(fn):
            raise ValueError(f"{'loss_fn' if step is None else 'step'} must be callable, got {fn!r}")
        self.model, self.threads, self.lr, self.loss_fn = model, threads, float(lr), loss_fn
        self._step: StepLoss = step if step is not None else (lambda m, xb, yb: loss_fn(m(xb), yb))
        self.batch_size = batch_size
        self._params = [p for p in model.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError("model has no trainable parameters")
        self._data = [p.data for p in self._params]  # aliases: same storage, own version counter
        self._device = self._params[0].device
        self._stop = threading.Event()
        self._state = threading.Lock()  # guards _active and the stop flag's reset
        self._active = False

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {value!r}")
        self._batch_size = value

    @property
    def numel(self) -> int:
        """Total trainable parameter count P (length of the flat vectors)."""
        return sum(p.numel() for p in self._params)

    def flat_params(self) -> torch.Tensor:
        """A ``[P]`` copy of the trainable parameters in ``model.parameters()`` order (the layout
        of :class:`GradientAccumulator` and :meth:`load_flat`)."""
        with torch.no_grad():
            return torch.cat([d.reshape(-1) for d in self._data]).clone()

    def load_flat(self, flat: torch.Tensor) -> None:
        """Overwrite the trainable parameters from a ``[P]`` vector (e.g. fresh values from the
        PS). Safe to call during a run: it races the threads' updates like they race each
        other."""
        if flat.dim() != 1 or flat.numel() != self.numel:
            raise ValueError(f"expected a flat [{self.numel}] tensor, got shape {tuple(flat.shape)}")
        offset = 0
        with torch.no_grad():
            for d in self._data:
                d.copy_(flat[offset:offset + d.numel()].view_as(d))
                offset += d.numel()

    @property
    def running(self) -> bool:
        """Whether a run is in progress."""
        return self._active

    def stop(self) -> None:
        """Ask the run in progress to stop; threads finish their current batch."""
        self._stop.set()

    def run(self, X: torch.Tensor, y: torch.Tensor, *, epochs: int | None = 1, max_updates: int | None = None,
            max_seconds: float | None = None, seed: int = 0,
            accumulator: GradientAccumulator | None = None) -> HogwildStats:
        """Train on ``X`` ``[N, ...]`` and targets ``y`` ``[N, ...]`` until the first of
        ``epochs`` passes, ``max_updates`` updates (all threads together) or ``max_seconds``
        seconds (threads finish the batch they hold, so the run lasts up to one batch longer).
        At least one bound must be set. With ``accumulator``, every update's gradient is also
        added to it. Re-raises the first exception a thread hit, after stopping the others."""
        if X.shape[:1] != y.shape[:1] or X.shape[0] < 1:
            raise ValueError(f"X and y must hold the same number (>= 1) of examples, got {tuple(X.shape)} and {tuple(y.shape)}")
        if epochs is not None and (not isinstance(epochs, int) or epochs < 1):
            raise ValueError(f"epochs must be None or an int >= 1, got {epochs!r}")
        if max_updates is not None and (not isinstance(max_updates, int) or max_updates < 1):
            raise ValueError(f"max_updates must be None or an int >= 1, got {max_updates!r}")
        if max_seconds is not None and (not isinstance(max_seconds, (int, float)) or not max_seconds > 0):
            raise ValueError(f"max_seconds must be None or seconds > 0, got {max_seconds!r}")
        if epochs is None and max_updates is None and max_seconds is None:
            raise ValueError("run needs a bound: epochs, max_updates or max_seconds")
        if accumulator is not None and accumulator.numel != self.numel:
            raise ValueError(f"accumulator holds {accumulator.numel} values, the model has {self.numel}")
        with self._state:
            if self._active:
                raise RuntimeError("this HogwildTrainer is already running; one run at a time")
            # reset before the run becomes visible: a stop() from anyone who saw running=True counts
            self._stop.clear()
            self._active = True
        try:
            start = time.perf_counter()
            deadline = start + max_seconds if max_seconds is not None else None
            cursor = _Cursor(X.shape[0], epochs, max_updates, deadline, seed, self._stop)
            results: list[ThreadStats | None] = [None] * self.threads
            errors: list[BaseException] = []
            workers = [
                threading.Thread(target=self._thread_main, args=(k, X, y, cursor, accumulator, results, errors),
                                 name=f"hogwild-{k}", daemon=True)
                for k in range(self.threads)
            ]
            for t in workers:
                t.start()
            for t in workers:
                t.join()
            wall = time.perf_counter() - start
            if errors:
                raise errors[0]
            return HogwildStats(tuple(r for r in results if r is not None), wall, self.batch_size)
        finally:
            with self._state:
                self._active = False

    def accumulate_gradients(self, X: torch.Tensor, y: torch.Tensor, accumulator: GradientAccumulator, *,
                             epochs: int | None = 1, max_updates: int | None = None, max_seconds: float | None = None,
                             seed: int = 0) -> HogwildStats:
        """:meth:`run` that also adds every update's gradient to ``accumulator``, for a worker
        that trains its local replica Hogwild-style and, from another thread or task,
        periodically ``drain`` s the accumulator, pushes it to the PS and :meth:`load_flat` s
        the parameters the PS answers with."""
        if not isinstance(accumulator, GradientAccumulator):
            raise ValueError(f"accumulator must be a GradientAccumulator, got {type(accumulator).__name__}")
        return self.run(X, y, epochs=epochs, max_updates=max_updates, max_seconds=max_seconds, seed=seed,
                        accumulator=accumulator)

    def _thread_main(self, k: int, X: torch.Tensor, y: torch.Tensor, cursor: _Cursor,
                     accumulator: GradientAccumulator | None, results: list, errors: list) -> None:
        updates = samples = 0
        busy = cpu = loss_sum = 0.0
        try:
            while True:
                idx = cursor.take(self._batch_size)
                if idx is None:
                    break
                t0, c0 = time.perf_counter(), time.thread_time()
                xb = X[idx].to(self._device, non_blocking=True)
                yb = y[idx].to(self._device, non_blocking=True)
                with torch.enable_grad():
                    loss = self._step(self.model, xb, yb)
                    grads = torch.autograd.grad(loss, self._params)
                with torch.no_grad():
                    for d, g in zip(self._data, grads):
                        d.add_(g, alpha=-self.lr)  # the unlocked Hogwild write
                if accumulator is not None:
                    accumulator.add(grads, idx.numel())
                loss_sum += float(loss.detach())
                busy += time.perf_counter() - t0
                cpu += time.thread_time() - c0
                updates += 1
                samples += idx.numel()
        except BaseException as exc:  # noqa: BLE001 - handed to run(), which re-raises it
            errors.append(exc)
            self._stop.set()
        results[k] = ThreadStats(k, updates, samples, busy, cpu, loss_sum)


__all__ = ["ThreadStats", "HogwildStats", "AccumulatedGradient", "GradientAccumulator", "HogwildTrainer"]
