"""Typed messages: one frozen, slotted dataclass per kind, tagged by :class:`Kind`.

Every message carries ``sender`` (node id) and ``rid`` (request id; a reply repeats the id of
the request it answers, 0 for one-way messages). The remaining fields are the kind's own, each
either a *scalar field* (travels inside the msgpack header) or a *tensor field* (annotated
``Tensor`` or ``tuple[Tensor, ...]``; travels as raw frames after the header). The codec derives
the wire schema from these annotations, so adding a kind is adding a class here.

Control kinds (membership, heartbeats, scheduling) are apart from data kinds (tensors).
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch

Tensor = torch.Tensor
PROTOCOL_VERSION = 1


class Kind(enum.Enum):
    """Message kinds; the value is the name used on the wire."""

    # control
    JOIN = "join"
    WELCOME = "welcome"
    HEARTBEAT = "heartbeat"
    LEAVE = "leave"
    SHUTDOWN = "shutdown"
    ACK = "ack"
    ERROR = "error"
    REPORT = "report"
    ASSIGN = "assign"
    STATUS = "status"
    WORK = "work"
    STAGE_ASSIGN = "stage_assign"
    RING_ASSIGN = "ring_assign"
    SHM = "shm"
    SHM_RELEASE = "shm_release"
    SUBMIT = "submit"
    DROP = "drop"
    DISCOVER = "discover"
    SHARDS = "shards"
    REPLICAS = "replicas"
    # data
    INIT = "init"
    PUSH = "push"
    PULL = "pull"
    PARAMS = "params"
    TENSORS = "tensors"
    ACTIVATIONS = "activations"
    GRADIENTS = "gradients"
    RING = "ring"
    REPLICATE = "replicate"

    @property
    def is_control(self) -> bool:
        return self in _CONTROL


_CONTROL = frozenset({Kind.JOIN, Kind.WELCOME, Kind.HEARTBEAT, Kind.LEAVE, Kind.SHUTDOWN, Kind.ACK,
                      Kind.ERROR, Kind.REPORT, Kind.ASSIGN, Kind.STATUS, Kind.WORK,
                       Kind.STAGE_ASSIGN, Kind.RING_ASSIGN, Kind.SHM, Kind.SHM_RELEASE, Kind.SUBMIT,
                      Kind.DROP, Kind.DISCOVER, Kind.SHARDS, Kind.REPLICAS})


def _tensor_bytes(t: Any) -> tuple[str, tuple[int, ...], bytes]:
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(t))
    t = t.detach().cpu().contiguous()
    return str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _field_equal(a: Any, b: Any) -> bool:
    if isinstance(a, (torch.Tensor, np.ndarray)) or isinstance(b, (torch.Tensor, np.ndarray)):
        if not isinstance(a, (torch.Tensor, np.ndarray)) or not isinstance(b, (torch.Tensor, np.ndarray)):
            return False
        return _tensor_bytes(a) == _tensor_bytes(b)  # bitwise: NaN == NaN, -0.0 != 0.0
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_field_equal(x, y) for x, y in zip(a, b))
    return a == b


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Message:
    """Base of all messages. Equality compares kind and fields; tensors bitwise."""

    kind: ClassVar[Kind]
    #: A one-way message (``rid`` 0) of this kind that the receiver refuses is answered with an
    #: ``error`` of ``rid`` 0 (docs/protocol.md, "Error replies"); other one-way messages never are.
    #: For senders that stream one-way messages and must hear at once that the stream is refused.
    refusals_answered: ClassVar[bool] = False
    sender: str = ""
    rid: int = 0
    #: the job's identity (``[job] token``): a receiver with a token refuses messages without it
    job_token: str = ""

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(_field_equal(getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self))

    __hash__ = None  # type: ignore[assignment]

    def replace(self, **changes: Any) -> Message:
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        parts = [f"{self.sender or '?'} {self.kind.value}"]
        if self.rid:
            parts.append(f"#{self.rid}")
        for f in dataclasses.fields(self):
            if f.name in ENVELOPE_FIELDS:
                continue
            v = getattr(self, f.name)
            if f.metadata.get("quiet") and v == f.default:  # an optional field not in use
                continue
            if isinstance(v, torch.Tensor):
                parts.append(f"{f.name}={_short_tensor(v)}")
            elif isinstance(v, tuple) and v and isinstance(v[0], torch.Tensor):
                total = sum(t.numel() * t.element_size() for t in v)
                parts.append(f"{f.name}=[{len(v)} tensors, {total} B]")
            elif isinstance(v, (tuple, list, dict)) and len(v) > 6:
                parts.append(f"{f.name}=<{len(v)} items>")
            else:
                parts.append(f"{f.name}={v!r}")
        return " ".join(parts)


#: the base fields every kind has; they travel as header keys of their own, not in ``fields``
ENVELOPE_FIELDS = ("sender", "rid", "job_token")


def _short_tensor(t: Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


MESSAGE_TYPES: dict[Kind, type[Message]] = {}


def message(kind: Kind):
    """Class decorator: make a frozen slotted message dataclass and register it for ``kind``."""

    def wrap(cls: type) -> type[Message]:
        cls.kind = kind  # type: ignore[attr-defined]
        out = dataclasses.dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)(cls)
        if kind in MESSAGE_TYPES:
            raise TypeError(f"kind {kind} registered twice")
        MESSAGE_TYPES[kind] = out
        return out

    return wrap


# ----------------------------------------------------------------------------- payloads

class Payload:
    """Base of the typed maps control messages carry (a frozen dataclass per shape): on the wire a msgpack map of
    the fields that are not None, as a ``dict`` field travels; the codec checks a received one's keys and values
    against the annotations (unknown or missing keys and wrong types are ``bad_field`` errors)."""

    __slots__ = ()

    def wire(self) -> dict[str, Any]:
        """The map that travels: the fields that are not None (nested payloads stay payloads)."""
        return {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}

    def __repr__(self) -> str:  # the fields sent only: a welcome's log line is not a list of Nones
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.wire().items())})"


def payload_wire(obj: Any) -> dict[str, Any]:
    """msgpack's ``default`` hook: a :class:`Payload` as its map; anything else is not serializable."""
    if isinstance(obj, Payload):
        return obj.wire()
    raise TypeError(f"can not serialize {type(obj).__name__!r} object")


def payload(cls: type) -> type:
    """Class decorator: a frozen, slotted, keyword-only payload dataclass."""
    return dataclasses.dataclass(frozen=True, slots=True, kw_only=True, repr=False)(cls)


@payload
class RingInfo(Payload):
    """A worker's first ring (welcome ``info.ring``; later ones come as :class:`RingAssign`): generation
    ``generation`` of the workers ``members`` (rank order) at ``addresses``, the worker at ``rank``."""

    generation: int
    members: tuple[str, ...]
    addresses: tuple[str, ...]
    rank: int


@payload
class ReplicaInfo(Payload):
    """Who holds each chunk group now (welcome ``info.replicas``): ``groups`` and ``epoch`` as in :class:`Replicas`."""

    groups: tuple[tuple[str, ...], ...]
    epoch: int


@payload
class WelcomeInfo(Payload):
    """What a welcome tells the node it admits (docs/protocol.md, "Membership"); None fields are not sent.

    Every node: ``shards`` (``[id, address]`` in shard-index order; empty for a shard that joins before every
    shard has). A worker: it is ``worker_index`` of ``num_workers`` (allreduce: its ring rank and the ring's
    size) with ``batch_size`` first, its ``ring`` (allreduce), ``resume`` (its counters in the previous part of a
    resumed job) and ``start_epoch``, and ``shards_down`` and ``shard_epoch`` when shards changed since the
    start. A restarted shard: the ``workers`` still in the job and (replicated shards) ``replicas``."""

    shards: tuple[tuple[str, str], ...] = ()
    workers: tuple[str, ...] | None = None
    replicas: ReplicaInfo | None = None
    worker_index: int | None = None
    num_workers: int | None = None
    batch_size: int | None = None
    resume: dict[str, float] | None = None
    start_epoch: int | None = None
    shards_down: tuple[str, ...] | None = None
    shard_epoch: int | None = None
    ring: RingInfo | None = None


class RowGrads(NamedTuple):
    """Row-sparse gradients as they travel together (docs/protocol.md, "Row-sparse tables"): ``grads[i]``
    (``[k, dim]``) is the gradient of rows ``rows[i]`` (int64, chunk-relative, strictly increasing) of chunk
    ``keys[i]``. On the wire they are a message's ``row_keys``, ``rows`` and ``row_grads`` (:meth:`fields`)."""

    keys: tuple[int, ...] = ()
    rows: tuple[Tensor, ...] = ()
    grads: tuple[Tensor, ...] = ()

    def fields(self) -> dict[str, tuple]:
        """As the keyword arguments of a :class:`Push` or :class:`Replicate`."""
        return {"row_keys": self.keys, "rows": self.rows, "row_grads": self.grads}


# ----------------------------------------------------------------------------- control kinds

@message(Kind.JOIN)
class Join(Message):
    """Node -> scheduler: I am up. Answered by :class:`Welcome`."""

    role: str
    address: str = ""
    pid: int = 0


@message(Kind.WELCOME)
class Welcome(Message):
    """Scheduler -> node: accepted; ``info`` carries membership and assignments."""

    heartbeat_interval_s: float
    info: WelcomeInfo = WelcomeInfo()


@message(Kind.HEARTBEAT)
class Heartbeat(Message):
    """Node -> scheduler, every ``heartbeat_interval_s``. Answered by :class:`Ack` or :class:`Shutdown`."""

    step: int = 0


@message(Kind.LEAVE)
class Leave(Message):
    """Node -> scheduler: I am stopping (``reason``). Answered by :class:`Ack`."""

    reason: str = ""


@message(Kind.SHUTDOWN)
class Shutdown(Message):
    """Tells the receiver to stop gracefully; as a reply, tells the requester the job is over.

    To the scheduler with ``finish`` set: end the job early but as if a stop rule had fired (workers
    stop, the final evaluation runs, the report is written) instead of interrupting it."""

    reason: str = ""
    finish: bool = False


@message(Kind.ACK)
class Ack(Message):
    """Generic success reply."""

    detail: str = ""


@message(Kind.ERROR)
class Error(Message):
    """Error reply: ``code`` is machine-readable (see docs/protocol.md), ``message`` for humans;
    ``blamed``, the address of the node the refusal is due to, where it names one (``ring_aborted``)."""

    code: str
    message: str
    blamed: str = ""


@message(Kind.REPORT)
class Report(Message):
    """Worker -> scheduler: progress since start (cumulative counters, rates in per second)."""

    metrics: dict[str, float]
    done: bool = False


@message(Kind.ASSIGN)
class Assign(Message):
    """Scheduler -> worker: batch size and data share to use from now on."""

    batch_size: int
    data_share: float = 1.0
    stop: bool = False


@message(Kind.STATUS)
class Status(Message):
    """A request for a node's state (empty ``state``) or its answer (``state`` filled)."""

    state: dict[str, Any] = dataclasses.field(default_factory=dict)


@message(Kind.WORK)
class Work(Message):
    """First-come-first-served data: a worker asks for ``count`` examples; the scheduler answers
    with the range ``[start, start + count)`` of epoch ``epoch``'s shuffled order (``count`` 0:
    the epochs are used up)."""

    count: int
    epoch: int = 0
    start: int = 0


@message(Kind.STAGE_ASSIGN)
class StageAssign(Message):
    """Scheduler -> worker: its part of pipeline plan ``plan`` (docs/pipeline.md). Answered by :class:`Ack`.

    The worker runs layers ``[start, stop)`` of the model as stage ``stage`` (-1: standby, no
    layers) of ``stages``; it is worker ``index`` of the ``width`` workers of its stage. ``prev``/``next`` are the
    addresses of the neighbouring stages' workers in index order: micro-batch ``m`` goes to
    worker ``m % len(next)``. Steps of ``batch_size`` examples in ``micro_batches`` micro-batches
    start at step ``start_step``; ``steps`` is the last step (exclusive) of the job.
    """

    plan: int
    stage: int
    stages: int = 0
    start: int = 0
    stop: int = 0
    index: int = 0
    width: int = 1
    prev: tuple[str, ...] = ()
    next: tuple[str, ...] = ()
    micro_batches: int = 1
    batch_size: int = 0
    start_step: int = 0
    steps: int = 0


@message(Kind.RING_ASSIGN)
class RingAssign(Message):
    """Scheduler -> worker (``consistency = "allreduce"``): the ring it belongs to from now on.

    Generation ``ring`` of the job's ring has the workers ``members`` (ids, in rank order) at
    ``addresses``; the receiver is member ``rank``. Sent when the ring is re-formed after a member
    was lost; a worker's first ring comes in its welcome. Answered by :class:`Ack`."""

    ring: int
    members: tuple[str, ...]
    addresses: tuple[str, ...]
    rank: int


@message(Kind.SHM)
class ShmHello(Message):
    """Shared-memory handshake between a client and a server on one host (docs/protocol.md, "Shared
    memory"). ``host`` is the sender's host identity, ``segment`` its probe segment (which names its
    arena) holding ``token`` in its first bytes; ``mapped``: the sender has mapped the receiver's
    probe and read its token. Client -> server with ``mapped`` false: answered by a ``ShmHello`` of
    the server's (``mapped``: the server reads the client's segments; ``segment`` empty: the server
    offers none). Client -> server with ``mapped`` true: answered by :class:`Ack` (replies may now
    use the server's reply slots)."""

    host: str
    segment: str
    token: str
    mapped: bool = False


@message(Kind.SHM_RELEASE)
class ShmRelease(Message):
    """One-way (``rid`` 0), client -> server: the client (whose probe is ``segment``) is done with one
    reference per entry of ``slots`` to the server's reply slots."""

    segment: str
    slots: tuple[int, ...]


@message(Kind.SUBMIT)
class Submit(Message):
    """Client -> job manager (``hmp-submit``, docs/jobs.md): run the job file ``job`` (its TOML text;
    ``path`` names it in errors and resolves its relative data paths). Answered by :class:`Ack` whose
    ``detail`` is the job's id, or an ``error`` (code ``bad_config``: the file is refused, nothing else changes).
    The job's progress and result: a ``status`` request to the manager (``state.jobs[id]``)."""

    job: str
    path: str = ""


@message(Kind.DROP)
class Drop(Message):
    """Scheduler -> PS shard: worker ``node`` is gone (lost, failed or left; ``reason``): sync rounds
    and SSP bounds stop waiting for it. Answered by :class:`Ack`. A worker that comes back is
    counted again from its next push."""

    node: str
    reason: str = ""


@message(Kind.DISCOVER)
class Discover(Message):
    """Any holder of the job token -> scheduler: where is the parameter server? Answered by a
    ``Discover`` whose ``ps`` holds ``shards`` (``[id, address]`` in shard-index order; empty until every
    shard has joined), ``chunks`` (``[key, dtype, start, numel]``), ``assignment`` (shard index as a
    string -> chunk keys) and ``parameters`` (``[name, dtype, offset, numel, shape]``); empty for a job
    without shards (docs/protocol.md, "Taking part from outside the topology")."""

    ps: dict[str, Any] = dataclasses.field(default_factory=dict)


@message(Kind.SHARDS)
class Shards(Message):
    """Scheduler -> worker: a PS shard went down or came back (docs/protocol.md, "Shard restarts").
    ``shards`` is ``[[id, address], ...]`` in shard-index order (a restarted shard's new address);
    ``down`` the shards lost and expected back (pushes to them wait); ``epoch`` counts these changes,
    so that an older one arriving late is ignored. Answered by :class:`Ack`. On it a worker abandons
    its pushes in flight and sends them again, with the same ``seq``, once no shard is down."""

    shards: tuple[tuple[str, str], ...] = ()
    down: tuple[str, ...] = ()
    epoch: int = 0


@message(Kind.REPLICAS)
class Replicas(Message):
    """Scheduler -> PS shard (``[ps] replicas = 2``; docs/resilience.md): who holds each chunk group now.
    ``groups`` is ``[[group, primary, backup], ...]``: a group is the chunks first assigned to the shard of
    that id, ``primary`` the shard serving them, ``backup`` the shard keeping a copy ("": none, the group
    runs unreplicated). ``epoch`` orders these changes with :class:`Shards` (one counter): an older one
    arriving late is ignored. A shard named primary of a group it held as backup takes over at once
    (promotion); a primary whose group has a new backup sends it a copy (:class:`Replicate`, ``op``
    ``"state"``). ``shards`` is ``[[id, address], ...]`` of the shards (where the backups are). Answered by
    :class:`Ack` once the shard acts on it."""

    groups: tuple[tuple[str, ...], ...] = ()
    shards: tuple[tuple[str, str], ...] = ()
    epoch: int = 0


# ----------------------------------------------------------------------------- data kinds

@message(Kind.INIT)
class Init(Message):
    """Set chunk values (``keys[i]`` gets ``values[i]``) on a PS shard. Answered by :class:`Ack`."""

    keys: tuple[int, ...]
    values: tuple[Tensor, ...]


@message(Kind.PUSH)
class Push(Message):
    """Worker -> shard: gradients for chunks ``keys``, computed at parameter version ``version``
    from ``samples`` examples. Answered by :class:`Params` with the chunks' new values.

    ``seq`` (0: none): the sender's push number, increasing across its pushes and its restarts (a
    worker starts from its start time in microseconds). A shard applies a push whose ``seq`` is not
    above the last one it applied from that sender only once: a retried push (its reply was lost
    with a crashed shard) is answered with the current values and not applied again."""

    keys: tuple[int, ...]
    grads: tuple[Tensor, ...]
    version: int = 0
    samples: int = 0
    seq: int = dataclasses.field(default=0, metadata={"quiet": True})  # not in reprs while 0
    #: row-sparse tables (docs/protocol.md, "Row-sparse tables"): ``row_grads[i]`` (``[k, dim]``) is the
    #: gradient of rows ``rows[i]`` (int64, chunk-relative, strictly increasing) of chunk ``row_keys[i]``
    row_keys: tuple[int, ...] = dataclasses.field(default=(), metadata={"quiet": True})
    rows: tuple[Tensor, ...] = dataclasses.field(default=(), metadata={"quiet": True})
    row_grads: tuple[Tensor, ...] = dataclasses.field(default=(), metadata={"quiet": True})
    #: rows whose new values the reply carries besides ``keys``'s (the sender's next batch's rows)
    want_keys: tuple[int, ...] = dataclasses.field(default=(), metadata={"quiet": True})
    want_rows: tuple[Tensor, ...] = dataclasses.field(default=(), metadata={"quiet": True})

    @property
    def sparse_grads(self) -> RowGrads:
        return RowGrads(self.row_keys, self.rows, self.row_grads)


@message(Kind.PULL)
class Pull(Message):
    """Worker -> shard: current values of chunks ``keys`` (whole), and of rows ``rows[i]`` of row-sparse
    chunk ``row_keys[i]`` (docs/protocol.md, "Row-sparse tables"). Answered by :class:`Params`."""

    keys: tuple[int, ...]
    row_keys: tuple[int, ...] = dataclasses.field(default=(), metadata={"quiet": True})
    rows: tuple[Tensor, ...] = dataclasses.field(default=(), metadata={"quiet": True})


@message(Kind.PARAMS)
class Params(Message):
    """Shard -> worker: values of chunks ``keys`` at parameter version ``version``; ``row_values[i]``
    (``[k, dim]``) are the rows of row-sparse chunk ``row_keys[i]`` the request asked for (a push's
    ``want_rows[i]``, a pull's ``rows[i]``), in the request's order."""

    keys: tuple[int, ...]
    values: tuple[Tensor, ...]
    version: int = 0
    row_keys: tuple[int, ...] = dataclasses.field(default=(), metadata={"quiet": True})
    row_values: tuple[Tensor, ...] = dataclasses.field(default=(), metadata={"quiet": True})


@message(Kind.TENSORS)
class Tensors(Message):
    """Named tensors between nodes (pipeline activations/gradients, benchmarks)."""

    name: str
    tensors: tuple[Tensor, ...]
    step: int = 0
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


@message(Kind.ACTIVATIONS)
class Activations(Message):
    """Pipeline stage -> next stage, one-way: the output of micro-batch ``micro_batch`` of step
    ``step`` under plan ``plan``; ``labels`` ride along for the last stage's loss."""

    plan: int
    step: int
    micro_batch: int
    values: Tensor
    labels: Tensor


@message(Kind.GRADIENTS)
class Gradients(Message):
    """Pipeline stage -> previous stage, one-way: the loss gradient with respect to the
    activations of micro-batch ``micro_batch`` of step ``step`` under plan ``plan``."""

    plan: int
    step: int
    micro_batch: int
    grads: Tensor


@message(Kind.RING)
class RingPiece(Message):
    """Ring member -> next member (docs/collective.md): part ``part`` of ring step ``step`` of
    collective operation ``op`` in ring generation ``ring``. One-way or a request
    (docs/collective.md, "One-way pieces"): the reply (:class:`Ack`) says the receiver is done
    reading ``values`` (it may be a shared-memory view) and, for a last-step piece, every piece of
    the operation it got from the sender. A refused one-way piece is answered with an ``error``
    of ``rid`` 0."""

    refusals_answered: ClassVar[bool] = True
    ring: int
    op: int
    step: int
    part: int
    values: Tensor


@message(Kind.REPLICATE)
class Replicate(Message):
    """Primary shard -> the backup of its chunk group ``group`` (docs/resilience.md): apply what the
    primary applied, in the primary's order. ``fseq`` numbers the primary's forwards of the group
    (1, 2, ...; a state copy restarts the count at its own ``fseq``): the backup applies ``fseq`` =
    last + 1, answers a repeat (``fseq`` <= last) without applying it, and refuses a gap.

    ``op``: ``"push"`` (async, ssp: ``worker``'s push number ``seq`` with ``grads`` for ``keys`` from
    ``samples`` examples, applied as the primary applied it); ``"round"`` (sync: the round's averaged
    gradients, ``round_seqs`` the push numbers it applied per worker); ``"init"`` (chunk values set by
    ``init``, in ``grads``); ``"state"`` (a whole copy: ``grads`` is one uint8 tensor, the serialized
    state of the group's chunks, optimizer, version and push numbers). Answered by :class:`Ack` once
    applied: only then does the primary answer the push it forwarded."""

    group: str
    fseq: int
    op: str = "push"
    keys: tuple[int, ...] = ()
    grads: tuple[Tensor, ...] = ()
    worker: str = ""
    seq: int = 0
    samples: int = 0
    round_seqs: dict[str, int] = dataclasses.field(default_factory=dict)
    #: row-sparse gradients applied with ``grads`` (``op`` push or round), as in :class:`Push`
    row_keys: tuple[int, ...] = dataclasses.field(default=(), metadata={"quiet": True})
    rows: tuple[Tensor, ...] = dataclasses.field(default=(), metadata={"quiet": True})
    row_grads: tuple[Tensor, ...] = dataclasses.field(default=(), metadata={"quiet": True})

    @property
    def sparse_grads(self) -> RowGrads:
        return RowGrads(self.row_keys, self.rows, self.row_grads)


# ----------------------------------------------------------------------------- schema

@dataclasses.dataclass(frozen=True, slots=True)
class FieldSpec:
    """How one field travels: ``tensor`` fields as frames, the rest in the header."""

    name: str
    annotation: Any
    tensor: bool
    many: bool  # tuple[Tensor, ...] rather than one Tensor
    required: bool


def _schema(cls: type[Message]) -> tuple[FieldSpec, ...]:
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        if f.name in ENVELOPE_FIELDS:
            continue
        ann = hints[f.name]
        tensor = ann is torch.Tensor or ann == tuple[torch.Tensor, ...]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        specs.append(FieldSpec(f.name, ann, tensor, tensor and ann is not torch.Tensor, required))
    return tuple(specs)


SCHEMAS: dict[Kind, tuple[FieldSpec, ...]] = {k: _schema(c) for k, c in MESSAGE_TYPES.items()}
