"""The Hogwild trainer's pure parts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hmp.train.hogwild import GradientAccumulator, HogwildTrainer
from tests.support import small_model, small_problem


def test_load_flat_round_trips_and_checks_shape():
    """load_flat writes the model's storage in parameter order and refuses wrong sizes."""
    model = small_model()
    trainer = HogwildTrainer(model, threads=1, lr=0.05, batch_size=8, loss_fn=nn.CrossEntropyLoss())
    flat = torch.arange(trainer.numel, dtype=torch.float32)
    trainer.load_flat(flat)
    torch.testing.assert_close(trainer.flat_params(), flat)
    assert model[0].weight[0, 1].item() == 1.0
    with pytest.raises(ValueError, match=f"\\[{trainer.numel}\\]"):
        trainer.load_flat(torch.zeros(trainer.numel + 1))


@pytest.mark.parametrize(
    "kwargs",
    [dict(threads=0), dict(lr=0.0), dict(batch_size=0), dict(loss_fn=None), dict(threads=True)],
)
def test_invalid_trainer_arguments_raise(kwargs):
    """Constructor arguments out of range raise ValueError naming what was expected."""
    args = dict(model=small_model(), threads=1, lr=0.1, batch_size=8, loss_fn=nn.CrossEntropyLoss()) | kwargs
    with pytest.raises(ValueError):
        HogwildTrainer(**args)


def test_invalid_run_arguments_raise():
    """run() refuses mismatched data, no bound at all, bad bounds and a wrong-sized accumulator."""
    X, y = small_problem()
    trainer = HogwildTrainer(small_model(), threads=1, lr=0.1, batch_size=8, loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="same number"):
        trainer.run(X, y[:-1])
    with pytest.raises(ValueError, match="needs a bound"):
        trainer.run(X, y, epochs=None)
    with pytest.raises(ValueError, match="max_updates"):
        trainer.run(X, y, max_updates=0)
    with pytest.raises(ValueError, match="accumulator"):
        trainer.run(X, y, accumulator=GradientAccumulator(3))
    with pytest.raises(ValueError, match="accumulator must be"):
        trainer.accumulate_gradients(X, y, accumulator=None)
