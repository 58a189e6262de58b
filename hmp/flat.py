"""Flat parameter buffers and their chunks (after PHub).

A model's trainable parameters are laid out in one flat 1-D buffer per dtype (every parameter a
view into it), and the buffers are cut into :class:`Chunk` s of at most ``chunk_bytes`` bytes
regardless of parameter boundaries. Chunks, not parameters, are what workers push and pull and
what is placed on PS shards, which keeps every message and every shard's load near the same size
whatever the model looks like. Row-sparse tables are laid out as :class:`RowTable` s of whole
rows. A model's persistent buffers (BatchNorm running statistics) can be laid out too, in buffer
chunks of their own, so that they travel with the parameters (docs/buffers.md). See
docs/architecture.md, "Parameter-server data path".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

DEFAULT_CHUNK_BYTES = 1 << 20  # 1 MiB: big enough to amortise per-message cost, small enough to balance


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: the spelling used in :class:`Chunk` and on the wire."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; raises ``ValueError`` for names torch does not know."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}; expected a torch dtype name such as 'float32'")
    return dtype


def _itemsize(name: str) -> int:
    return torch_dtype(name).itemsize


@dataclass(frozen=True, slots=True)
class ParamSlot:
    """Where one parameter lives: elements ``[offset, offset + numel)`` of the ``dtype`` flat buffer."""

    name: str
    dtype: str
    offset: int  # elements, not bytes
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Chunk:
    """A contiguous piece of one flat buffer: elements ``[start, start + numel)`` of ``dtype``.

    ``key`` is unique across all dtypes of a layout and is what workers and shards
    use to name the chunk on the wire.
    """

    key: int
    dtype: str
    start: int  # elements into the dtype's flat buffer
    numel: int
    #: a row-sparse table's chunk: its row width (0: a dense chunk), and the table row its element 0 is
    #: the first element of; the chunk holds rows ``[row0, row0 + numel // dim)`` of table ``table``
    dim: int = 0
    row0: int = 0
    table: str = ""

    @property
    def rows(self) -> int:
        """Whole rows in a row-sparse chunk (0 for a dense one)."""
        return self.numel // self.dim if self.dim else 0

    @property
    def end(self) -> int:
        """One past the last element (exclusive bound)."""
        return self.start + self.numel

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self.numel * _itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class RowTable:
    """A row-sparse table: parameter ``name`` (``rows`` x ``dim``, elements ``[offset, offset + rows * dim)``
    of the ``dtype`` buffer), the weight of an ``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True``."""

    name: str
    dtype: str
    offset: int
    rows: int
    dim: int


@dataclass(frozen=True, slots=True, eq=False)
class FlatBuffers:
    """The flat buffers a bound model uses: ``params[dtype]`` and ``grads[dtype]``, each 1-D.

    With row-sparse tables (:class:`RowTable`): ``sparse`` holds their parameters (whose ``.grad`` is
    the sparse gradient autograd makes, not a view of ``grads``) and ``dense_ranges`` the
    ``(dtype, start, end)`` element ranges of ``grads`` that hold the other parameters' gradients."""

    params: dict[str, Tensor]
    grads: dict[str, Tensor]
    sparse: tuple[nn.Parameter, ...] = ()
    dense_ranges: tuple[tuple[str, int, int], ...] = ()
    #: the module buffers' flat buffers by dtype (a layout with buffers: :attr:`FlatLayout.buffers`); every
    #: laid-out buffer of the model is a view into one of them
    buffers: dict[str, Tensor] = field(default_factory=dict)

    def zero_grad(self) -> None:
        """Zero the flat grad buffers in place; use this instead of ``optimizer.zero_grad()``. The
        sparse tables' gradients are dropped instead (set to None: the next backward makes new ones)."""
        if not self.sparse:
            for g in self.grads.values():
                g.zero_()
            return
        for d, lo, hi in self.dense_ranges:
            self.grads[d][lo:hi].zero_()
        for p in self.sparse:
            p.grad = None


@dataclass(frozen=True)
class FlatLayout:
    """The layout of a model's trainable parameters in one flat buffer per dtype.

    ``slots``: one :class:`ParamSlot` per parameter, in ``named_parameters()`` order.
    ``sizes``: ``(dtype, numel)`` per flat buffer, dtypes in order of first appearance.
    ``chunks``: the chunks of every buffer, keys ``0..len-1`` in (dtype, start) order.
    ``chunk_bytes``: the largest chunk size in bytes this layout was cut with.
    ``tables``: the row-sparse tables (:class:`RowTable`), whose chunks hold whole rows (a chunk holds
    ``table_chunk_bytes // (dim * itemsize)`` rows, at least one).
    ``table_chunk_bytes``: the tables' chunk size in bytes (0: ``chunk_bytes``). A sparse push or pull costs a
    little per table chunk it touches, and a batch touches rows all over a table, so tables are cut coarser.
    ``buffers``: one :class:`ParamSlot` per persistent module buffer (any dtype; :func:`persistent_buffers`),
    in their own flat buffers (``buffer_sizes``), cut into ``buffer_chunks`` whose keys follow every
    parameter chunk's. Empty unless asked for (``from_model(..., buffers=True)``): buffers have no gradient,
    and ``chunks`` stays the parameters' alone, so gradient code never meets them (docs/buffers.md).

    The layout depends only on parameter names, shapes and dtypes, so every worker
    building the same model gets the same layout (compare with ``==``).
    """

    slots: tuple[ParamSlot, ...]
    sizes: tuple[tuple[str, int], ...]
    chunks: tuple[Chunk, ...]
    chunk_bytes: int
    tables: tuple[RowTable, ...] = ()
    table_chunk_bytes: int = 0
    buffers: tuple[ParamSlot, ...] = ()
    buffer_sizes: tuple[tuple[str, int], ...] = ()
    buffer_chunks: tuple[Chunk, ...] = ()

    # ------------------------------------------------------------------ building

    @classmethod
    def from_named_parameters(
        cls, named: Iterable[tuple[str, Tensor]], chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        row_tables: Iterable[str] = (), table_chunk_bytes: int = 0,
    ) -> FlatLayout:
        """Lay out ``(name, tensor)`` pairs (those with ``requires_grad``) and cut chunks. ``row_tables``: the
        names of the 2-D parameters to lay out as row-sparse tables (chunk boundaries on row boundaries), cut
        into chunks of about ``table_chunk_bytes`` (0: ``chunk_bytes``)."""
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        if not isinstance(table_chunk_bytes, int) or table_chunk_bytes < 0:
            raise ValueError(f"table_chunk_bytes must be an int >= 0, got {table_chunk_bytes!r}")
        slots: list[ParamSlot] = []
        sizes: dict[str, int] = {}
        row_tables = set(row_tables)
        tables: list[RowTable] = []
        for name, p in named:
            if not p.requires_grad:
                continue
            if not p.is_floating_point():
                raise ValueError(f"parameter {name!r} has dtype {p.dtype}; expected a floating-point dtype")
            d = dtype_name(p.dtype)
            offset = sizes.get(d, 0)
            slots.append(ParamSlot(name, d, offset, p.numel(), tuple(p.shape)))
            sizes[d] = offset + p.numel()
            if name in row_tables:
                if p.dim() != 2 or p.shape[1] < 1:
                    raise ValueError(f"row-sparse table {name!r} has shape {list(p.shape)}; expected [rows, dim]")
                tables.append(RowTable(name, d, offset, p.shape[0], p.shape[1]))
        chunks: list[Chunk] = []
        for d, total in sizes.items():
            per_chunk = chunk_bytes // _itemsize(d)
            if per_chunk < 1:
                raise ValueError(f"chunk_bytes={chunk_bytes} is smaller than one {d} element ({_itemsize(d)} bytes)")
            # Dense runs between tables are cut ignoring parameter boundaries (with no table: the whole
            # buffer, as always); a table is cut on row boundaries.
            pos = 0
            for t in (t for t in tables if t.dtype == d):
                for start in range(pos, t.offset, per_chunk):
                    chunks.append(Chunk(len(chunks), d, start, min(per_chunk, t.offset - start)))
                per_rows = max(1, (table_chunk_bytes or chunk_bytes) // _itemsize(d) // t.dim)
                for row in range(0, t.rows, per_rows):
                    n = min(per_rows, t.rows - row)
                    chunks.append(Chunk(len(chunks), d, t.offset + row * t.dim, n * t.dim, t.dim, row, t.name))
                pos = t.offset + t.rows * t.dim
            for start in range(pos, total, per_chunk):
                chunks.append(Chunk(len(chunks), d, start, min(per_chunk, total - start)))
        return cls(tuple(slots), tuple(sizes.items()), tuple(chunks), chunk_bytes, tuple(tables), table_chunk_bytes)

    @classmethod
    def from_model(cls, model: nn.Module, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                   table_chunk_bytes: int = 0, buffers: bool = False) -> FlatLayout:
        """Lay out ``model``'s trainable parameters (its row-sparse tables: :func:`row_sparse_tables`);
        see :meth:`from_named_parameters`. ``buffers``: its persistent buffers too (:meth:`with_buffers`)."""
        layout = cls.from_named_parameters(model.named_parameters(), chunk_bytes, row_sparse_tables(model),
                                           table_chunk_bytes)
        return layout.with_buffers(persistent_buffers(model)) if buffers else layout

    def with_buffers(self, named: Iterable[tuple[str, Tensor]]) -> FlatLayout:
        """This layout plus the buffers ``named`` (``(name, tensor)``, e.g. :func:`persistent_buffers`): one
        flat buffer per dtype, cut every ``chunk_bytes`` like the parameters, chunk keys after the parameters'
        (any buffers this layout had are replaced)."""
        slots: list[ParamSlot] = []
        sizes: dict[str, int] = {}
        for name, b in named:
            d = dtype_name(b.dtype)
            offset = sizes.get(d, 0)
            slots.append(ParamSlot(name, d, offset, b.numel(), tuple(b.shape)))
            sizes[d] = offset + b.numel()
        chunks: list[Chunk] = []
        key = len(self.chunks)
        for d, total in sizes.items():
            per_chunk = max(1, self.chunk_bytes // _itemsize(d))
            for start in range(0, total, per_chunk):
                chunks.append(Chunk(key, d, start, min(per_chunk, total - start)))
                key += 1
        return dataclasses.replace(self, buffers=tuple(slots), buffer_sizes=tuple(sizes.items()),
                                   buffer_chunks=tuple(chunks))

    # ------------------------------------------------------------------ queries

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The dtype names of the flat buffers, in layout order."""
        return tuple(d for d, _ in self.sizes)

    def numel(self, dtype: str) -> int:
        """Elements in the flat buffer of ``dtype``."""
        for d, n in self.sizes:
            if d == dtype:
                return n
        raise KeyError(f"layout has no {dtype!r} buffer; it has {list(self.dtypes)}")

    @property
    def nbytes(self) -> int:
        """Total bytes over all flat buffers."""
        return sum(n * _itemsize(d) for d, n in self.sizes)

    def dense_ranges(self) -> tuple[tuple[str, int, int], ...]:
        """``(dtype, start, end)``: the element ranges of the flat buffers outside every row-sparse table."""
        out: list[tuple[str, int, int]] = []
        for d, total in self.sizes:
            pos = 0
            for t in sorted((t for t in self.tables if t.dtype == d), key=lambda t: t.offset):
                if t.offset > pos:
                    out.append((d, pos, t.offset))
                pos = t.offset + t.rows * t.dim
            if total > pos:
                out.append((d, pos, total))
        return tuple(out)

    # ------------------------------------------------------------------ buffers

    def allocate(self, device: torch.device | str | None = None) -> dict[str, Tensor]:
        """New zeroed flat buffers ``{dtype: Tensor[numel]}`` on ``device`` (default CPU)."""
        return {d: torch.zeros(n, dtype=torch_dtype(d), device=device) for d, n in self.sizes}

    def allocate_buffers(self, device: torch.device | str | None = None) -> dict[str, Tensor]:
        """New zeroed flat buffers for the module buffers, ``{dtype: Tensor[numel]}`` (empty without any)."""
        return {d: torch.zeros(n, dtype=torch_dtype(d), device=device) for d, n in self.buffer_sizes}

    def check(self, model: nn.Module) -> None:
        """Raise ``ValueError`` naming the first difference if ``model`` does not match this layout."""
        other = FlatLayout.from_model(model, self.chunk_bytes, self.table_chunk_bytes)
        if self.buffers:
            theirs = [(n, dtype_name(b.dtype), tuple(b.shape)) for n, b in persistent_buffers(model)]
            mine = [(s.name, s.dtype, s.shape) for s in self.buffers]
            if theirs != mine:
                diff = next((f"layout has {a}, model has {b}" for a, b in zip(mine, theirs) if a != b),
                            f"layout has {len(mine)} buffers, model has {len(theirs)}")
                raise ValueError(f"model's buffers do not match layout: {diff}")
        if other.slots == self.slots:
            return
        mine = [s.name for s in self.slots]
        theirs = [s.name for s in other.slots]
        if mine != theirs:
            raise ValueError(f"model does not match layout: layout has parameters {mine}, model has {theirs}")
        for a, b in zip(self.slots, other.slots):
            if (a.dtype, a.shape) != (b.dtype, b.shape):
                raise ValueError(
                    f"model does not match layout at parameter {a.name!r}: layout has {a.dtype}{list(a.shape)}, "
                    f"model has {b.dtype}{list(b.shape)}"
                )
        raise ValueError("model does not match layout")  # unreachable: offsets follow from shapes

    def flatten(self, model: nn.Module, device: torch.device | str | None = None) -> dict[str, Tensor]:
        """Copy ``model``'s current parameter values into new flat buffers (e.g. to seed a PS)."""
        self.check(model)
        if device is None:
            device = _first_device(model)
        flat = self.allocate(device)
        params = dict(model.named_parameters())
        views = self.param_views(flat)
        with torch.no_grad():
            for name, view in views.items():
                view.copy_(params[name])
        return flat

    def param_views(self, flat: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``{param name: view shaped like the parameter}`` into ``flat`` (no copies)."""
        self._check_flat(flat)
        return {s.name: flat[s.dtype][s.offset : s.offset + s.numel].view(s.shape) for s in self.slots}

    def buffer_views(self, flat: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``{buffer name: view shaped like the buffer}`` into the buffers' flat buffers ``flat`` (no copies)."""
        for d, n in self.buffer_sizes:
            t = flat.get(d)
            if t is None or t.dim() != 1 or t.numel() != n or dtype_name(t.dtype) != d:
                raise ValueError(f"flat {d!r} buffer for module buffers is "
                                 f"{'missing' if t is None else dtype_name(t.dtype) + str(list(t.shape))}; "
                                 f"expected {d}[{n}] (1-D)")
        return {s.name: flat[s.dtype][s.offset : s.offset + s.numel].view(s.shape) for s in self.buffers}

    def bind(self, model: nn.Module, device: torch.device | str | None = None) -> FlatBuffers:
        """Move ``model``'s parameters and gradients into new flat buffers; return the buffers.

        Each parameter's ``.data`` becomes a view into ``params[dtype]`` (current values
        copied in) and its ``.grad`` a view into ``grads[dtype]`` (current grad copied,
        else zeros). Autograd accumulates into an existing ``.grad`` in place (when
        ``create_graph=False``), so after ``backward()`` the gradients are already in the
        flat grad buffer with no copy.

        The binding survives only while nobody replaces ``.grad``: clear gradients with
        :meth:`FlatBuffers.zero_grad` or ``optimizer.zero_grad(set_to_none=False)`` /
        ``model.zero_grad(set_to_none=False)``. The default ``set_to_none=True`` sets
        ``.grad = None`` and the next backward allocates a fresh, unbound grad tensor.
        ``backward(create_graph=True)`` also replaces ``.grad`` (out of place).

        ``device``: where the flat buffers live; default the device of the first parameter.

        A row-sparse table's ``.grad`` is not bound (docs/architecture.md): it is set to None. A layout with
        buffers binds them too: each module buffer is replaced by a view into ``buffers[dtype]`` (its current
        values copied in; modules update their buffers in place, so they keep writing into the flat buffer).
        """
        self.check(model)
        if device is None:
            device = _first_device(model)
        params = dict(model.named_parameters())
        tables = {t.name for t in self.tables}
        flat = FlatBuffers(self.allocate(device), self.allocate(device), tuple(params[n] for n in tables),
                           self.dense_ranges() if tables else (), self.allocate_buffers(device))
        if self.buffers:
            _bind_buffers(model, self.buffer_views(flat.buffers))
        pviews, gviews = self.param_views(flat.params), self.param_views(flat.grads)
        with torch.no_grad():
            for name, p in params.items():
                if name not in pviews:
                    continue  # frozen parameter: not part of the layout
                pviews[name].copy_(p.data)
                if name in tables:
                    p.data = pviews[name]
                    p.grad = None
                    continue
                if p.grad is not None:
                    gviews[name].copy_(p.grad)
                p.data = pviews[name]
                p.grad = gviews[name]
        return flat

    def move_grads(self, model: nn.Module, flat: FlatBuffers, alloc: Callable[[int, torch.dtype], Tensor]) -> None:
        """Move ``flat``'s gradient buffers into memory from ``alloc(numel, dtype)`` (e.g.
        :meth:`hmp.transport.shm.Arena.alloc`, so that pushes carry references, not bytes).

        Done once, at set-up (the current gradients are copied over: not a data-path copy); every
        parameter's ``.grad`` then views the new buffer, so backward accumulates straight into it.
        Callers must take gradient views (``chunk_views``) after this, not before."""
        params = dict(model.named_parameters())
        tables = {t.name for t in self.tables}
        for d, n in self.sizes:
            old = flat.grads[d]
            new = alloc(n, torch_dtype(d))
            if new.dim() != 1 or new.numel() != n or new.dtype != old.dtype or new.device != old.device:
                raise ValueError(f"alloc gave {dtype_name(new.dtype)}{list(new.shape)} on {new.device} for the "
                                 f"{d}[{n}] gradient buffer on {old.device}")
            with torch.no_grad():
                if not tables:
                    new.copy_(old)
                else:  # the tables' part is never read (see bind): left unwritten, it costs no memory
                    for rd, lo, hi in flat.dense_ranges:
                        if rd == d:
                            new[lo:hi].copy_(old[lo:hi])
            flat.grads[d] = new
        for name, view in self.param_views(flat.grads).items():
            if name not in tables:  # a table's sparse gradient stays its own (see bind)
                params[name].grad = view

    def _check_flat(self, flat: Mapping[str, Tensor]) -> None:
        for d, n in self.sizes:
            t = flat.get(d)
            if t is None:
                raise ValueError(f"flat buffers lack the {d!r} buffer; expected dtypes {list(self.dtypes)}")
            if t.dim() != 1 or t.numel() != n or dtype_name(t.dtype) != d:
                raise ValueError(
                    f"flat {d!r} buffer is {dtype_name(t.dtype)}{list(t.shape)}; expected {d}[{n}] (1-D)"
                )


def row_sparse_tables(model: nn.Module) -> tuple[str, ...]:
    """The names (as in ``model.named_parameters()``) of the weights of ``model``'s ``nn.Embedding`` and
    ``nn.EmbeddingBag`` modules built with ``sparse=True``: the row-sparse tables."""
    out = []
    for prefix, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
            out.append(f"{prefix}.weight" if prefix else "weight")
    return tuple(out)


def persistent_buffers(model: nn.Module) -> list[tuple[str, Tensor]]:
    """``model``'s buffers that its ``state_dict`` holds (not those registered with ``persistent=False``,
    which a module makes itself, nor None placeholders), each once, in ``named_buffers()`` order."""
    out = []
    for name, b in model.named_buffers():
        prefix, _, attr = name.rpartition(".")
        owner = model.get_submodule(prefix) if prefix else model
        if attr in owner._non_persistent_buffers_set:
            continue
        out.append((name, b))
    return out


def _bind_buffers(model: nn.Module, views: Mapping[str, Tensor]) -> None:
    """Every module buffer named in ``views`` (and any module holding the same tensor under another name)
    replaced by its view, its current value copied in."""
    by_id = {}
    with torch.no_grad():
        for name, view in views.items():
            old = model.get_buffer(name)
            view.copy_(old)
            by_id[id(old)] = view
    for m in model.modules():
        for attr, b in m._buffers.items():
            if b is not None and id(b) in by_id:
                m._buffers[attr] = by_id[id(b)]


def _first_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def chunk_views(flat: Tensor | Mapping[str, Tensor], chunks: Iterable[Chunk]) -> dict[int, Tensor]:
    """``{chunk.key: flat[chunk.dtype][start:end]}``, 1-D views in ``chunks`` order (no copies).

    ``flat`` is either the ``{dtype: buffer}`` mapping or a single 1-D buffer, in which
    case every chunk must be of that buffer's dtype.
    """
    out: dict[int, Tensor] = {}
    for c in chunks:
        if isinstance(flat, Tensor):
            buf = flat
            if dtype_name(buf.dtype) != c.dtype:
                raise ValueError(f"chunk {c.key} is {c.dtype} but the flat buffer is {dtype_name(buf.dtype)}")
        else:
            buf = flat.get(c.dtype)
            if buf is None:
                raise ValueError(f"chunk {c.key} needs a {c.dtype!r} flat buffer; have {sorted(flat)}")
        if buf.dim() != 1 or c.end > buf.numel():
            raise ValueError(
                f"chunk {c.key} spans elements [{c.start}, {c.end}) but the flat buffer has shape {list(buf.shape)}"
            )
        out[c.key] = buf[c.start : c.end]
    return out
