"""A client for running PS shards, usable from any asyncio program.

    async with PSClient.from_config(cfg, shards) as ps:   # shards: [(id, address), ...]
        await ps.pull()                 # model parameters <- shards
        loss = ...; loss.backward()     # gradients land in the flat grad buffer
        await ps.push(samples=32)       # gradients -> shards; replies carry the new values

``push`` sends each shard one ``push`` message whose frames are views of the flat gradient buffer
(no concatenation copy) and writes the values in the ``params`` reply straight into the model's
parameters (the one necessary copy: receive frame -> parameter storage).

Shared memory (``[shm] enabled``, the default; docs/shm.md): the client moves the flat gradient
buffer into its process's shared-memory arena once, at construction, so that a push to a shard on
the same host carries references instead of bytes, and the shard's reply comes back as views of
its reply slots, released once written into the parameters. Other shards get frames as before.

CURVE (``[security] curve = true``; docs/security.md): a program outside the topology dials the
shards with its own key of the job's key folder (``hmp-keygen DIR --client NAME``), either given
(``security=Curve.load(DIR, NAME, serve=False)``) or, with :meth:`PSClient.from_config`, read from
the config's ``key_dir`` under the client's ``name``. A key the job did not issue fails the first
request with :class:`~hmp.transport.security.HandshakeFailed` within ``handshake_timeout_s``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable, Sequence
from typing import Any

import torch

from hmp import job
from hmp.config import Config
from hmp.messages import Leave, Message, Params, Pull, Push
from hmp.ps.sharding import ShardedModel
from hmp.train.evaluate import evaluate, evaluate_sweep
from hmp.transport.codec import Limits
from hmp.transport import security as sec
from hmp.transport.endpoint import Client
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
        self._params = sharded.param_views()
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
        self._staging: dict[int, torch.Tensor] | None = None
        if device.type != "cpu":
            # CUDA gradients cross to the CPU explicitly, once per push, into pinned staging buffers.
            self._staging = {k: torch.empty(g.shape, dtype=g.dtype, pin_memory=True) for k, g in self._grads.items()}
        self.version = 0
        self.bytes_out = 0
        self.bytes_in = 0

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
        if security is None and sec.process_security() is None:
            security = sec.from_config(cfg, name, serve=False) or False
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
        self.version = max(self.version, reply.version)
        if reply.sender:  # each shard's own clock: how far a shard that died had got (docs/protocol.md, "Shard restarts")
            self.shard_versions[reply.sender] = reply.version
        self.bytes_in += sum(v.numel() * v.element_size() for v in reply.values)

    async def pull(self) -> None:
        """Fetch every chunk's current value into the model's parameters."""
        replies = await asyncio.gather(*(c.request(Pull(keys=keys)) for _, c, keys in self.shards if keys))
        for r in replies:
            self._write(r)

    async def push(self, samples: int = 0, seq: int = 0) -> int:
        """Send the flat gradient buffer's chunks to their shards; apply the new values. Returns the version.
        ``seq``: the push's number (messages.Push; a retry sends the same, and a shard applies it once)."""
        for r in await asyncio.gather(*self.push_requests(samples, seq)):
            self._write(r)
        return self.version

    def push_requests(self, samples: int = 0, seq: int = 0) -> list[Coroutine[Any, Any, Message]]:
        """The requests of :meth:`push`, one per shard holding keys, not yet sent (they send when first
        run); each returns its shard's ``params`` reply, which :meth:`write` applies. Until every reply
        has arrived the gradient buffer must not be written (the frames are its own memory)."""
        grads = self._grads
        if self._staging is not None:
            for k, g in grads.items():
                self._staging[k].copy_(g, non_blocking=True)
            torch.cuda.synchronize()
            grads = self._staging
        # The gradient buffer is not touched again before the replies arrive, and a reply implies
        # the request was fully received, so the zero-copy send needs no tracker here.
        reqs = []
        for _, c, keys in self.shards:
            if keys:
                g = tuple(grads[k] for k in keys)
                self.bytes_out += sum(t.numel() * t.element_size() for t in g)
                reqs.append(c.request(Push(keys=keys, grads=g, version=self.version, samples=samples, seq=seq)))
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
        """Test accuracy and loss of the current parameters on ``dataset`` (default: the config's)."""
        if dataset is None:
            if self.cfg is None:
                raise ValueError("evaluate() needs a dataset when the client was built without a config")
            dataset = job.dataset(self.cfg)
        if self.sharded.array is not None:
            return evaluate_sweep(self.sharded.array, dataset.x_test, dataset.y_test)
        return evaluate(self.model, dataset.x_test, dataset.y_test)

