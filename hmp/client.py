"""A client for running PS shards, usable from any asyncio program.

:class:`PSClient` pulls the model's parameters from the shards and pushes the flat gradient buffer
to them, one message per shard whose frames view the buffer (no concatenation copy), writing each
reply's values straight into the parameters; the model's buffers (BatchNorm running statistics) go
with every push as values and come back with every reply and pull (docs/buffers.md). It uses shared
memory with shards on its host,
row-sparse pushes for sparse tables and CURVE keys when the job has them. One push or pull at a
time: a reply's rows are matched to the ids last asked for. See docs/protocol.md ("Taking part
from outside the topology"), docs/shm.md and docs/security.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from typing import Any

import torch

from hmp.config import Config
from hmp.messages import Leave, Message, Params, Pull, Push
from hmp.ps.sharding import ShardedModel
from hmp.train.evaluate import evaluate, evaluate_sweep
from hmp.train.task import task_of
from hmp.transport.codec import Limits
from hmp.transport import security as sec
from hmp.transport import Client, process_settings
from hmp.transport.security import Curve
from hmp.transport.shm import Arena, ShmSettings, open_process_arena


class PSClient:
    """Talks to every shard of one model; the model's parameters live in ``sharded``'s flat buffers."""

    def __init__(self, sharded: ShardedModel, shards: Sequence[tuple[str, str]], *, name: str = "client",
                 cfg: Config | None = None, timeout_s: float = 60.0, shm: bool | None = None,
                 security: Curve | bool | None = None) -> None:
        """``shm``: use shared memory with shards on this host (None: as ``cfg``'s ``[shm] enabled``
        says, off without a config). CPU models only (a CUDA model's gradients are staged anyway).
        ``security``: the CURVE keys to dial the shards with (hmp.transport.security), False for
        plain, None for this process's (a daemon's own; plain elsewhere)."""
        if len(shards) != len(sharded.assignment):
            raise ValueError(f"the model's chunks are assigned to {len(sharded.assignment)} shards, "
                             f"{len(shards)} given")
        self.sharded, self.cfg, self.name = sharded, cfg, name
        #: the module buffers' chunks (``{key: view}``): pushed as values, written from replies like parameters
        self._buffers = sharded.buffer_views()
        self._params = {**sharded.param_views(), **self._buffers}
        device = next(iter(self._params.values())).device if self._params else torch.device("cpu")
        self.arena: Arena | None = None
        if (cfg is not None and cfg.shm.enabled if shm is None else shm) and device.type == "cpu":
            settings = ShmSettings.of(cfg.shm) if cfg is not None else ShmSettings()
            self.arena = open_process_arena(cfg.job.name if cfg is not None else "api", name, settings)
            if self.arena is not None:
                self._grads_into(self.arena)
        kw: dict[str, Any] = {"name": name, "timeout_s": timeout_s, "shm": self.arena or False, "security": security}
        if cfg is not None:  # the job's token too: its shards refuse messages of other jobs
            kw.update(limits=Limits.of(cfg.limits), frame_bytes=cfg.limits.frame_bytes, job_token=cfg.job.token)
        self._client_kw = kw  # a restarted shard's new connection (readdress) is made the same way
        self.shard_versions: dict[str, int] = {}  # the version of the last reply from each shard, by id
        self.shards = [(sid, Client(addr, **kw), tuple(sharded.assignment[i])) for i, (sid, addr) in enumerate(shards)]
        self._all_shards = list(self.shards)
        self._grads = sharded.grad_views()
        layout = sharded.layout
        #: row-sparse chunks by key, and each table's chunks in row order (``(first row, key)``)
        self._row_chunks = {c.key: c for c in layout.chunks if c.dim}
        self._table_chunks: dict[str, list[tuple[int, int]]] = {t.name: [] for t in layout.tables}
        for c in self._row_chunks.values():
            self._table_chunks[c.table].append((c.row0, c.key))
        for chunks in self._table_chunks.values():
            chunks.sort()
        #: each table's chunks' first rows, for the searchsorted of every push and pull (made once)
        self._table_starts = {name: torch.tensor([r for r, _ in chunks], dtype=torch.int64)
                              for name, chunks in self._table_chunks.items()}
        named = dict(sharded.model.named_parameters())
        self._table_params = {name: named[name] for name in self._table_chunks}
        self._wanted: dict[int, torch.Tensor] = {}  # chunk key -> the row ids last asked for (replies' rows)
        self._staging: dict[int, torch.Tensor] | None = None
        if device.type != "cpu":
            # CUDA gradients cross to the CPU explicitly, once per push, into pinned staging buffers.
            self._staging = {k: torch.empty(g.shape, dtype=g.dtype, pin_memory=True) for k, g in self._grads.items()
                             if k not in self._row_chunks}
        self.version = 0
        self.bytes_out = 0
        self.bytes_in = 0
        self.rows_pushed = 0  # rows of row-sparse tables pushed (each a row of its table's width)

    def _grads_into(self, arena: Arena) -> None:
        """The flat gradient buffers into ``arena`` (once; a model whose buffers are there already stays)."""
        flat = self.sharded.flat
        if all(arena.locate(g) is not None for g in flat.grads.values() if g.numel()):
            return
        self.sharded.layout.move_grads(self.sharded.model, flat, arena.alloc)

    @classmethod
    def from_config(cls, cfg: Config, shards: Sequence[tuple[str, str]], *, name: str = "client",
                    device: str = "cpu", security: Curve | bool | None = None) -> PSClient:
        """A client of ``cfg``'s model. ``security`` None: this process's CURVE keys if it has any (a
        daemon), else, with ``[security] curve = true``, the keys of ``name`` in the config's
        ``key_dir`` (a missing key file is a ConfigError naming it)."""
        if security is None and process_settings().security is None:
            security = sec.from_config(cfg, name, serve=False) or False
        from hmp import job  # the job's assembly: only a client built from a config needs it

        return cls(job.sharded_model(cfg, device), shards, name=name, cfg=cfg,
                   timeout_s=cfg.limits.request_timeout_s, security=security)

    def restrict(self, keys: Iterable[int]) -> None:
        """Pull and push only the chunks ``keys`` from now on (a pipeline stage's own chunks)."""
        mine = set(keys)
        self.shards = [(sid, c, tuple(k for k in ks if k in mine)) for sid, c, ks in self._all_shards]

    async def readdress(self, shard_id: str, address: str) -> None:
        """Talk to shard ``shard_id`` at ``address`` from now on (it was restarted there; docs/protocol.md,
        "Shard restarts"); the old connection is closed, requests still waiting on it are abandoned."""
        old = next((c for sid, c, _ in self._all_shards if sid == shard_id), None)
        if old is None:
            raise ValueError(f"no shard {shard_id!r} in this client ({[sid for sid, _, _ in self._all_shards]})")
        if old.address == address:
            return
        new = Client(address, **self._client_kw)
        await new.connect()
        self._all_shards = [(sid, new if sid == shard_id else c, ks) for sid, c, ks in self._all_shards]
        self.shards = [(sid, new if sid == shard_id else c, ks) for sid, c, ks in self.shards]
        await old.close()

    @property
    def shard_addresses(self) -> list[tuple[str, str]]:
        """``[(shard id, address)]`` of every shard of the model, restricted or not."""
        return [(sid, c.address) for sid, c, _ in self._all_shards]

    @property
    def keys(self) -> tuple[int, ...]:
        """The chunk keys this client pulls and pushes."""
        return tuple(k for _, _, ks in self.shards for k in ks)

    def use_gradients(self, grads: dict[int, torch.Tensor]) -> None:
        """Push these chunk views (``{key: 1-D tensor}``, like :meth:`ShardedModel.grad_views`) instead
        of the model's own flat gradient buffer (views of memory outside :attr:`arena` travel inline;
        ``arena.alloc`` gives memory inside it)."""
        self._grads = grads

    @property
    def model(self) -> torch.nn.Module:
        return self.sharded.model

    @property
    def tables(self) -> tuple[str, ...]:
        """The names of the model's row-sparse tables (empty for a dense model)."""
        return tuple(self._table_chunks)

    @property
    def table_keys(self) -> tuple[int, ...]:
        """The chunk keys of the row-sparse tables this client pulls and pushes."""
        return tuple(k for k in self.keys if k in self._row_chunks)

    def _split_rows(self, table: str, ids: torch.Tensor) -> list[tuple[int, torch.Tensor, slice]]:
        """Sorted unique table row ids -> ``[(chunk key, chunk-relative ids, slice of ids)]`` for the chunks
        holding any (a searchsorted over the chunks' first rows: the ids are sorted)."""
        chunks = self._table_chunks[table]
        cuts = torch.searchsorted(ids, self._table_starts[table]).tolist() + [ids.numel()]
        out = []
        for i, (row0, key) in enumerate(chunks):
            lo, hi = cuts[i], cuts[i + 1]
            if hi > lo:
                out.append((key, ids[lo:hi] - row0, slice(lo, hi)))  # relative ids: a small new tensor
        return out

    def _rows_by_chunk(self, rows: Mapping[str, torch.Tensor]) -> dict[int, torch.Tensor]:
        """``{table name: row ids}`` -> ``{chunk key: sorted unique chunk-relative ids}``."""
        out: dict[int, torch.Tensor] = {}
        for name, ids in rows.items():
            if name not in self._table_chunks:
                raise ValueError(f"{name!r} is not a row-sparse table of this model; its tables: {list(self.tables)}")
            ids = torch.unique(torch.as_tensor(ids).reshape(-1).to("cpu", torch.int64))  # sorted, each once
            for key, rel, _ in self._split_rows(name, ids):
                out[key] = rel
        return out

    def _sparse_grads(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The tables' gradients as ``{chunk key: (chunk-relative row ids, row gradients [k, dim])}``."""
        out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, p in self._table_params.items():
            g = p.grad
            if g is None:
                continue  # no row of this table was looked up
            if not g.is_sparse:
                raise ValueError(f"row-sparse table {name!r} has a dense gradient; its module must be built with "
                                 "sparse=True and its .grad left to autograd (FlatBuffers.zero_grad)")
            # Coalescing copies: it sums the gradients of ids looked up more than once and sorts the ids,
            # which the wire wants (strictly increasing); the values are then sliced per chunk without a copy.
            g = g.coalesce()
            ids, values = g.indices()[0], g.values()
            if ids.device.type != "cpu":  # CUDA: the rows cross to the CPU (small; the dense part is staged)
                ids, values = ids.cpu(), values.cpu()
            for key, rel, part in self._split_rows(name, ids):
                out[key] = (rel, values[part])
        return out

    async def __aenter__(self) -> PSClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def connect(self) -> None:
        for _, client, _ in self.shards:
            await client.connect()

    async def close(self) -> None:
        for _, client, _ in self.shards:
            await client.close()

    def _write(self, reply: Params) -> None:
        with torch.no_grad():
            for k, v in zip(reply.keys, reply.values):
                # The one copy on the reply path: the new values land in the worker's own parameters
                # (the model's storage); the reply frames (or the shard's reply slot, in shared
                # memory) are read-only and released once the reply is dropped after this.
                self._params[k].copy_(v, non_blocking=False)
            for k, v in zip(reply.row_keys, reply.row_values):
                c, rows = self._row_chunks.get(k), self._wanted.get(k)
                if c is None or rows is None or tuple(v.shape) != (rows.numel(), c.dim):
                    raise ValueError(f"reply from {reply.sender or 'a shard'} carries rows of chunk {k} shaped "
                                     f"{list(v.shape)}, which this client did not ask for")
                view = self._params[k].view(-1, c.dim)
                view.index_copy_(0, rows.to(view.device), v.to(view.device))  # the one copy, as above
        self.bytes_in += sum(v.numel() * v.element_size() for v in reply.row_values)
        self.version = max(self.version, reply.version)
        if reply.sender:  # each shard's own clock: how far a shard that died had got (docs/protocol.md, "Shard restarts")
            self.shard_versions[reply.sender] = reply.version
        self.bytes_in += sum(v.numel() * v.element_size() for v in reply.values)

    async def pull(self, keys: Iterable[int] | None = None, rows: Mapping[str, torch.Tensor] | None = None) -> None:
        """Fetch chunks' current values into the model's parameters: every chunk (the default), the chunks
        ``keys``, or with ``rows`` (``{table name: row ids}``) the dense chunks whole and only those rows of
        the row-sparse tables (a table not named is not fetched)."""
        wanted = set(self.keys if keys is None else keys)
        by_chunk: dict[int, torch.Tensor] = {}
        if rows is not None:
            wanted -= set(self._row_chunks)
            by_chunk = self._rows_by_chunk(rows)
            self._wanted.update(by_chunk)
        requests = []
        for _, c, ks in self.shards:
            whole = tuple(k for k in ks if k in wanted)
            row_keys = tuple(k for k in ks if k in by_chunk)
            if whole or row_keys:
                requests.append(c.request(Pull(keys=whole, row_keys=row_keys,
                                               rows=tuple(by_chunk[k] for k in row_keys))))
        for r in await asyncio.gather(*requests):
            self._write(r)

    async def push(self, samples: int = 0, seq: int = 0, want: Mapping[str, torch.Tensor] | None = None) -> int:
        """Send the flat gradient buffer's chunks to their shards (a row-sparse table's: the rows of its
        sparse gradient); apply the new values. Returns the version. ``seq``: the push's number
        (messages.Push; a retry sends the same, and a shard applies it once). ``want``: ``{table name: row
        ids}`` whose new values the replies carry too (the next batch's rows)."""
        for r in await asyncio.gather(*self.push_requests(samples, seq, want)):
            self._write(r)
        return self.version

    def push_requests(self, samples: int = 0, seq: int = 0,
                      want: Mapping[str, torch.Tensor] | None = None) -> list[Coroutine[Any, Any, Message]]:
        """The requests of :meth:`push`, one per shard holding keys, not yet sent (they send when first
        run); each returns its shard's ``params`` reply, which :meth:`write` applies. Until every reply
        has arrived the gradient buffer must not be written (the frames are its own memory)."""
        grads = self._grads
        # The buffers' values, copied (they are small next to the parameters): a forward running while the push
        # is in flight (Hogwild threads) cannot change what is sent, and a CUDA model's cross to the CPU here.
        buffers = ({k: self._buffers[k].detach().to("cpu", copy=True) for k in self.keys if k in self._buffers}
                   if self._buffers else {})
        if self._staging is not None:
            for k, g in self._staging.items():
                g.copy_(grads[k], non_blocking=True)
            torch.cuda.synchronize()
            grads = self._staging
        rows = self._sparse_grads() if self._row_chunks else {}
        wanted = self._rows_by_chunk(want) if want else {}
        self._wanted.update(wanted)
        # The gradient buffer is not touched again before the replies arrive, and a reply implies
        # the request was fully received, so the zero-copy send needs no tracker here.
        reqs = []
        for _, c, keys in self.shards:
            if not keys:
                continue
            dense = tuple(k for k in keys if k not in self._row_chunks)
            g = tuple(buffers[k] if k in buffers else grads[k] for k in dense)
            row_keys = tuple(k for k in keys if k in rows)
            ids = tuple(rows[k][0] for k in row_keys)
            row_grads = tuple(rows[k][1] for k in row_keys)
            want_keys = tuple(k for k in keys if k in wanted)
            self.bytes_out += sum(t.numel() * t.element_size() for t in (*g, *ids, *row_grads))
            self.rows_pushed += sum(r.numel() for r in ids)
            reqs.append(c.request(Push(keys=dense, grads=g, version=self.version, samples=samples, seq=seq,
                                       row_keys=row_keys, rows=ids, row_grads=row_grads, want_keys=want_keys,
                                       want_rows=tuple(wanted[k] for k in want_keys))))
        return reqs

    def write(self, reply: Message) -> None:
        """Apply one shard's ``params`` reply (of :meth:`push_requests`) to the model's parameters."""
        assert isinstance(reply, Params), reply
        self._write(reply)

    async def leave(self, reason: str = "done", timeout_s: float = 5.0) -> None:
        """Tell every shard this client is done (it stops counting in sync rounds and SSP bounds);
        a shard that does not answer within ``timeout_s`` is not waited for longer."""
        await asyncio.gather(*(c.request(Leave(reason=reason), timeout_s=timeout_s) for _, c, _ in self.shards),
                             return_exceptions=True)

    def evaluate(self, dataset: Any = None) -> dict[str, float]:
        """The test metrics of the current parameters on ``dataset`` (default: the config's), under the config's
        ``[train] task`` (classification without a config)."""
        if dataset is None:
            if self.cfg is None:
                raise ValueError("evaluate() needs a dataset when the client was built without a config")
            from hmp import job  # the job's assembly: only for the config's own dataset

            dataset = job.dataset(self.cfg)
        if self.sharded.array is not None:
            return evaluate_sweep(self.sharded.array, dataset.x_test, dataset.y_test)
        return evaluate(self.model, dataset.x_test, dataset.y_test, task=task_of(self.cfg))

