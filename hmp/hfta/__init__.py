"""Horizontally fused training arrays (HFTA, Wang et al., MLSys 2021).

B copies of one model, each with its own hyper-parameters, trained as one wider model whose every
operator handles all B members at once (fewer, larger kernels); member b's results are those of
training it alone, up to float32 rounding. This package holds the fused operators, losses,
optimizers and schedulers, the converter (``fuse``) and ``FusedArray``, the sweep worker's facade.
See docs/hfta.md.
"""

from .array import FusedArray
from .base import FusedModule
from .conv import FusedConv1d, FusedConv2d
from .convert import (FUSED_OPS, FusedSequential, FusionRule, UnsupportedModuleError, fuse, fuse_models,
                      register_fused_op)
from .elementwise import FusedChannelwise, FusedElementwise, FusedFlatten, FusedSoftmax
from .embedding import FusedEmbedding, FusedFieldEmbedding
from .arrangement import DENSE, IMAGE, broadcast, member, member_major, stack
from .linear import FusedLinear
from .loss import fused_cross_entropy, fused_mse_loss
from .norm import FusedBatchNorm1d, FusedBatchNorm2d, FusedLayerNorm
from .optim import OPTIMIZERS, FusedAdam, FusedAdamW, FusedSGD, make_optimizer
from .lr_schedule import FusedCosineAnnealingLR, FusedLRScheduler, FusedStepLR

__all__ = [
    "DENSE", "FUSED_OPS", "IMAGE", "OPTIMIZERS", "FusedAdam", "FusedAdamW", "FusedArray",
    "FusedBatchNorm1d", "FusedBatchNorm2d", "FusedChannelwise", "FusedConv1d", "FusedConv2d",
    "FusedCosineAnnealingLR", "FusedElementwise", "FusedEmbedding", "FusedFieldEmbedding",
    "FusedFlatten", "FusedLRScheduler", "FusedLayerNorm", "FusedLinear", "FusedModule",
    "FusedSGD", "FusedSequential", "FusedSoftmax", "FusedStepLR", "FusionRule",
    "UnsupportedModuleError", "broadcast", "fuse", "fuse_models", "fused_cross_entropy",
    "fused_mse_loss", "make_optimizer", "member", "member_major", "register_fused_op", "stack",
]
