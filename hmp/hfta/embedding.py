"""Fused ``nn.Embedding`` and the project's ``FieldEmbedding`` (hmp.models)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from hmp.models import FieldEmbedding

from .base import FusedModule


class FusedEmbedding(FusedModule):
    """B copies of ``nn.Embedding(num_embeddings, embedding_dim)``.

    Input ``[B, N, *]`` int64 ids (``DENSE``; member b looks up in its own table), output
    ``[B, N, *, embedding_dim]``. Parameter ``weight [B, num_embeddings, embedding_dim]``.
    The B tables are looked up as one table of ``B * num_embeddings`` rows, member b's ids
    offset by ``b * num_embeddings``. ``padding_idx`` and ``scale_grad_by_freq`` behave as in
    torch (both per member); ``max_norm`` and ``sparse`` are not supported.
    """

    torch_type = nn.Embedding

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False, *, B: int,
                 device=None, dtype=None) -> None:
        super().__init__(B)
        if max_norm is not None:
            raise ValueError("FusedEmbedding does not support max_norm (it renormalises rows in "
                             "place during forward); expected max_norm=None")
        if sparse:
            raise ValueError("FusedEmbedding does not support sparse=True gradients; "
                             "expected sparse=False")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx must be within [-{num_embeddings}, "
                                 f"{num_embeddings}), got {padding_idx}")
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.scale_grad_by_freq = padding_idx, scale_grad_by_freq
        self.weight = nn.Parameter(torch.empty(B, num_embeddings, embedding_dim,
                                               device=device, dtype=dtype))
        self.register_buffer("_offsets", torch.arange(B, device=device) * num_embeddings,
                             persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[:, self.padding_idx].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() < 2 or ids.shape[0] != self.B:
            raise ValueError(f"FusedEmbedding expects ids [B={self.B}, N, *], got {tuple(ids.shape)}")
        offsets = self._offsets.view(self.B, *[1] * (ids.dim() - 1))
        table = self.weight.view(self.B * self.num_embeddings, self.embedding_dim)
        out = F.embedding(ids + offsets, table, scale_grad_by_freq=self.scale_grad_by_freq)
        if self.padding_idx is not None:
            # torch gives the padding row no gradient; detach the outputs that read it.
            pad = (ids == self.padding_idx).unsqueeze(-1)
            out = torch.where(pad, out.detach(), out)
        return out

    def load_member(self, b: int, module: nn.Module) -> None:
        self._check_member(b, module)
        if module.max_norm is not None or module.sparse:
            raise ValueError(f"FusedEmbedding: member {b} uses max_norm or sparse, not supported")
        if module.padding_idx != self.padding_idx:
            raise ValueError(f"FusedEmbedding: member {b} has padding_idx={module.padding_idx}, "
                             f"expected {self.padding_idx}")
        self._copy_in("weight", b, module.weight)

    def export_member(self, b: int) -> nn.Embedding:
        self._check_member(b)
        m = self._blank(nn.Embedding, self.num_embeddings, self.embedding_dim, self.padding_idx,
                        scale_grad_by_freq=self.scale_grad_by_freq)
        self._copy_out("weight", b, m.weight)
        return m.train(self.training)

    @classmethod
    def from_torch(cls, m: nn.Embedding, B: int) -> "FusedEmbedding":
        return cls(m.num_embeddings, m.embedding_dim, m.padding_idx, m.max_norm, m.norm_type,
                   m.scale_grad_by_freq, m.sparse, B=B, device=m.weight.device, dtype=m.weight.dtype)

    def extra_repr(self) -> str:
        return f"B={self.B}, {self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}"


class FusedFieldEmbedding(FusedModule):
    """B copies of ``hmp.models.FieldEmbedding``.

    Input ``[B, N, fields]`` int64 bucket ids (``DENSE``), output ``[B, N, fields * dim]``.
    Parameter ``table.weight [B, fields * buckets, dim]``.
    """

    torch_type = FieldEmbedding

    def __init__(self, fields: int, buckets: int, dim: int, *, B: int, device=None, dtype=None) -> None:
        super().__init__(B)
        self.fields, self.buckets, self.dim = fields, buckets, dim
        self.table = FusedEmbedding(fields * buckets, dim, B=B, device=device, dtype=dtype)
        nn.init.normal_(self.table.weight, std=0.05)
        self.register_buffer("offsets", torch.arange(fields, dtype=torch.int64, device=device) * buckets,
                             persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 3 or ids.shape[0] != self.B or ids.shape[2] != self.fields:
            raise ValueError(f"FusedFieldEmbedding expects ids [B={self.B}, N, {self.fields}], "
                             f"got {tuple(ids.shape)}")
        return self.table(ids + self.offsets).flatten(2)

    def load_member(self, b: int, module: nn.Module) -> None:
        self._check_member(b, module)
        if (module.fields, module.buckets, module.dim) != (self.fields, self.buckets, self.dim):
            raise ValueError(f"FusedFieldEmbedding: member {b} has (fields, buckets, dim)="
                             f"{(module.fields, module.buckets, module.dim)}, expected "
                             f"{(self.fields, self.buckets, self.dim)}")
        self.table.load_member(b, module.table)

    def export_member(self, b: int) -> FieldEmbedding:
        self._check_member(b)
        m = self._blank(FieldEmbedding, self.fields, self.buckets, self.dim)
        with torch.no_grad():
            m.table.weight.copy_(self.table.weight[b])
            m.offsets.copy_(self.offsets)
        return m.train(self.training)

    @classmethod
    def from_torch(cls, m: FieldEmbedding, B: int) -> "FusedFieldEmbedding":
        return cls(m.fields, m.buckets, m.dim, B=B, device=m.table.weight.device,
                   dtype=m.table.weight.dtype)

    def extra_repr(self) -> str:
        return f"B={self.B}, fields={self.fields}, buckets={self.buckets}, dim={self.dim}"
