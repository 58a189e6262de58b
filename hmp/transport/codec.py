"""The wire codec: pure functions between typed messages and frame lists. No sockets here.

``encode(msg) -> list[buffer]`` returns a msgpack header frame plus views of the tensors' own
memory, and ``decode(frames) -> Message`` returns tensors that view the received frames, so a
message crosses the codec without copies; ``decode`` raises only
:class:`~hmp.errors.ProtocolError`. Shared-memory references are located and resolved through
callbacks, which keeps the codec pure. The format and the zero-copy rules are in
docs/protocol.md.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import types
import typing
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from hmp.errors import ProtocolError
from hmp.messages import MESSAGE_TYPES, PROTOCOL_VERSION, SCHEMAS, FieldSpec, Kind, Message, Payload, payload_wire

# Received frames are read-only buffers; torch warns on every frombuffer over one. The views are
# documented as read-only, so the warning carries no information here.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

#: Tensors up to this many bytes travel in one frame and are decoded as views (no copy). Large on
#: purpose, against the ~1 MiB first planned: ZeroMQ hands over a multipart message only when all of
#: it has arrived, so small frames cannot pipeline anything, and a tensor cut into frames must be
#: copied back together by the receiver (docs/architecture.md, "Changes from DESIGN.md").
#: Single big frames were slow only because libzmq's buffer for a frame over 32 MiB is a fresh mmap
#: that faults in page by page; ``endpoint.tune_malloc()`` (daemons call it) removes that. Tensors
#: above this are still split (and copied together once on receipt); see bench/transport.py.
DEFAULT_FRAME_BYTES = 1 << 26

#: wire dtype name -> torch dtype. bfloat16 has no numpy twin and travels as its raw bytes.
DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float32": torch.float32, "float64": torch.float64,
}
_WIRE_NAME = {v: k for k, v in DTYPES.items()}
_ITEMSIZE = {name: torch.empty((), dtype=d).element_size() for name, d in DTYPES.items()}
HEADER_KEYS = frozenset({"version", "kind", "sender", "rid", "fields", "tensors"})
#: header keys a message may leave out: ``job_token`` (the job's identity, docs/protocol.md "Trust")
OPTIONAL_HEADER_KEYS = frozenset({"job_token"})
TENSOR_KEYS = frozenset({"field", "dtype", "shape", "frames"})
TENSOR_KEYS_SHM = TENSOR_KEYS | {"shm"}  #: a tensor in shared memory (module docstring)
MAX_RID = (1 << 64) - 1


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """Bounds every decoded message must respect, and what an endpoint may hold (config ``[limits]``).

    The bounds on counts are also bounds on time: what a message costs to receive, decode or refuse
    grows with its frames, tensor descriptors and header containers, not with its bytes (which are
    copied at memory speed, or not at all). At the defaults no single message costs a daemon more
    than a few milliseconds (``python bench/soak.py --costs`` measures the worst cases); ``encode(...,
    limits=)`` refuses on the sender's side what a receiver with the same limits would refuse.
    """

    max_frames: int = 4096  #: data frames per message
    max_message_bytes: int = 1 << 30  #: tensor bytes per message
    max_header_bytes: int = 1 << 20
    #: tensor descriptors per message: 1 GiB (the default max_message_bytes) in 1 MiB chunks (the
    #: default chunk size) is 1024; each costs a few microseconds to decode
    max_tensors: int = 1024
    max_rank: int = 8
    max_string: int = 1 << 16  #: characters in any header string
    #: maps and arrays in a header, counted while it is unpacked (a 1 MiB header of empty arrays
    #: holds a million); None: 2 per tensor descriptor (a map and its shape)
    #: plus 256
    max_containers: int | None = None
    #: nesting of the free-form (``Any``) values in ``fields``, e.g. ``tensors.meta``: deeper values
    #: would make every later repr, log line or copy of them recurse that deep
    max_depth: int = 32
    #: endpoints only (not the codec): queue memory per socket, peer and direction, which sizes the
    #: high-water marks (``endpoint.hwm_for``), and requests a server runs at once
    queue_bytes: int = 1 << 30
    max_inflight_requests: int = 1024

    @classmethod
    def of(cls, settings: Any) -> Limits:
        """The limits a job's ``[limits]`` section (any object with these attributes) sets."""
        return cls(max_frames=settings.max_frames, max_message_bytes=settings.max_message_bytes,
                   max_rank=settings.max_rank, queue_bytes=settings.queue_bytes,
                   max_inflight_requests=settings.max_inflight_requests)

    @property
    def container_limit(self) -> int:
        """``max_containers``, or its default when None."""
        return 2 * self.max_tensors + 256 if self.max_containers is None else self.max_containers


DEFAULT_LIMITS = Limits()


# ----------------------------------------------------------------------------- compiled schema

class _Mismatch(Exception):
    """A header value of the wrong type; ``path`` grows as it unwinds through containers.

    Internal: the where-string is only built when a value is wrong, not for every field."""

    def __init__(self, ann: Any, value: Any, why: str = "") -> None:
        self.ann, self.value, self.path, self.why = ann, value, "", why


#: check(value, limits) -> the value as the dataclass wants it; raises _Mismatch.
Checker = Callable[[Any, Limits], Any]


class _TooDeep(Exception):
    """A free-form header value nested deeper than ``limits.max_depth`` (internal, like _Mismatch)."""


_NESTED = (list, dict)


def _any(value: Any, limits: Limits) -> Any:
    # Breadth-first over the containers only: the header's container count (checked while it was
    # unpacked) bounds this walk, and without recursion the check itself copes with any depth.
    if type(value) not in _NESTED:
        return value
    level, depth = [value], 1
    while level:
        if depth > limits.max_depth:
            raise _TooDeep(f"nested deeper than the limit of {limits.max_depth}")
        inner = []
        for v in level:
            inner.extend(x for x in (v.values() if type(v) is dict else v) if type(x) in _NESTED)
        level, depth = inner, depth + 1
    return value


def _checker(ann: Any) -> Checker:
    """Compile a field annotation into a checker (done once per field at import)."""
    origin = getattr(ann, "__origin__", None)
    if ann is Any:
        return _any
    if isinstance(ann, types.UnionType):  # ``X | None``: a payload's optional field (None is left out when sent)
        inner = _checker(next(a for a in ann.__args__ if a is not type(None)))
        return lambda value, limits: None if value is None else inner(value, limits)
    if isinstance(ann, type) and issubclass(ann, Payload):
        return _payload_checker(ann)
    if ann is bool:
        def check_bool(value: Any, limits: Limits) -> Any:
            if value is True or value is False:
                return value
            raise _Mismatch(ann, value)
        return check_bool
    if ann is int:
        def check_int(value: Any, limits: Limits) -> Any:
            if type(value) is int or (isinstance(value, int) and not isinstance(value, bool)):
                return value
            raise _Mismatch(ann, value)
        return check_int
    if ann is float:
        def check_float(value: Any, limits: Limits) -> Any:
            if type(value) is float:
                return value
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            raise _Mismatch(ann, value)
        return check_float
    if ann is str:
        def check_str(value: Any, limits: Limits) -> Any:
            if isinstance(value, str) and len(value) <= limits.max_string:
                return value
            raise _Mismatch(ann, value)
        return check_str
    if origin is tuple:
        item_ann = ann.__args__[0]
        item = _checker(item_ann)

        def check_tuple(value: Any, limits: Limits) -> Any:
            if not isinstance(value, (list, tuple)):
                raise _Mismatch(ann, value)
            if item_ann is int and all(type(v) is int for v in value):  # the common case: keys
                return tuple(value)
            out = []
            for i, v in enumerate(value):
                try:
                    out.append(item(v, limits))
                except _Mismatch as exc:
                    exc.path = f"[{i}]{exc.path}"
                    raise
            return tuple(out)
        return check_tuple
    if origin is dict:
        key, val = (_checker(a) for a in ann.__args__)

        def check_dict(value: Any, limits: Limits) -> Any:
            if not isinstance(value, dict):
                raise _Mismatch(ann, value)
            out = {}
            for k, v in value.items():
                try:
                    ck = key(k, limits)
                except _Mismatch as exc:
                    exc.path = f" key{exc.path}"
                    raise
                try:
                    out[ck] = val(v, limits)
                except _Mismatch as exc:
                    exc.path = f"[{k!r}]{exc.path}"
                    raise
            return out
        return check_dict

    def check_unknown(value: Any, limits: Limits) -> Any:
        raise _Mismatch(ann, value)
    return check_unknown


def _payload_checker(cls: type[Payload]) -> Checker:
    """A payload's map -> the payload: every key one of its fields, every required field there, each value checked."""
    hints = typing.get_type_hints(cls)
    checks = {f.name: _checker(hints[f.name]) for f in dataclasses.fields(cls)}
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]

    def check_payload(value: Any, limits: Limits) -> Any:
        if not isinstance(value, dict):
            raise _Mismatch(cls, value)
        unknown = [k for k in value if k not in checks]
        missing = [k for k in required if k not in value]
        if unknown or missing:
            raise _Mismatch(cls, value, f"unexpected keys {sorted(map(str, unknown))}" if unknown else
                            f"missing keys {missing}")
        out = {}
        for k, v in value.items():
            try:
                out[k] = checks[k](v, limits)
            except _Mismatch as exc:
                exc.path = f"[{k!r}]{exc.path}"
                raise
        return cls(**out)
    return check_payload


def _field_error(where: str, exc: _Mismatch) -> ProtocolError:
    if exc.why:
        return ProtocolError(f"{where}{exc.path}: {exc.why} for {exc.ann.__name__}", "bad_field")
    name = getattr(exc.ann, "__name__", str(exc.ann))
    return ProtocolError(f"{where}{exc.path}: expected {name}, got {type(exc.value).__name__}", "bad_field")


@dataclasses.dataclass(frozen=True, slots=True)
class _Schema:
    """One kind's wire schema, compiled from its dataclass annotations."""

    kind: Kind
    wire: str  #: the kind's wire name (``kind.value``; enum attribute access is slow)
    cls: type[Message]
    specs: dict[str, FieldSpec]
    scalars: tuple[str, ...]  #: header fields, in declaration order
    checkers: dict[str, Checker]  #: scalar field name -> checker
    required: tuple[str, ...]  #: required scalar fields
    tensor_fields: tuple[FieldSpec, ...]


def _compile(kind: Kind) -> _Schema:
    specs = SCHEMAS[kind]
    return _Schema(kind=kind, wire=kind.value, cls=MESSAGE_TYPES[kind], specs={s.name: s for s in specs},
                   scalars=tuple(s.name for s in specs if not s.tensor),
                   checkers={s.name: _checker(s.annotation) for s in specs if not s.tensor},
                   required=tuple(s.name for s in specs if not s.tensor and s.required),
                   tensor_fields=tuple(s for s in specs if s.tensor))


# Looked up by wire name (decode) and by message class (encode): both hash faster than an Enum.
_BY_WIRE: dict[str, _Schema] = {k.value: _compile(k) for k in Kind}
_BY_CLASS: dict[type, _Schema] = {s.cls: s for s in _BY_WIRE.values()}


def _check_value(value: Any, ann: Any, where: str, limits: Limits) -> Any:
    """Check a header value against a field annotation; returns it as the dataclass wants it."""
    try:
        return _checker(ann)(value, limits)
    except _Mismatch as exc:
        raise _field_error(where, exc) from None


# ----------------------------------------------------------------------------- encode

def _as_tensor(value: Any, where: str) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise ProtocolError(f"{where}: unsupported numpy dtype {value.dtype}", "bad_dtype")
        # Not C-contiguous: made contiguous once, because the wire carries dense row-major bytes.
        value = torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise ProtocolError(f"{where}: expected a tensor, got {type(value).__name__}", "bad_field")
    if not value.is_cpu:
        raise ProtocolError(f"{where}: tensor on {value.device}; move it to the CPU explicitly before sending",
                            "bad_device")
    if value.dtype not in _WIRE_NAME:
        raise ProtocolError(f"{where}: unsupported dtype {value.dtype}", "bad_dtype")
    if value.requires_grad:
        value = value.detach()
    # Same reason as above: one contiguous copy of a strided tensor, none of a contiguous one.
    return value.contiguous()


def _frames_of(t: torch.Tensor, frame_bytes: int) -> list[memoryview]:
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return []
    if t.dim() != 1:
        t = t.reshape(-1)  # a view: t is contiguous
    if t.dtype is torch.bfloat16:
        t = t.view(torch.int16)  # same bytes; numpy has no bfloat16
    # A byte view of the tensor's own storage; the numpy array keeps the tensor alive.
    whole = memoryview(t.numpy()).cast("B")
    if nbytes <= frame_bytes:
        return [whole]
    return [whole[i:i + frame_bytes] for i in range(0, nbytes, frame_bytes)]


class _Packers(threading.local):
    """One reusable msgpack Packer per thread (a Packer is not thread-safe; making one per call
    costs more than packing a control message)."""

    def __init__(self) -> None:
        self.packer = msgpack.Packer(use_bin_type=True, default=payload_wire)


_packers = _Packers()


#: locate(tensor) -> [segment, offset, slot] of a (contiguous, CPU) tensor in shared memory, or None
Locate = Callable[[torch.Tensor], "list[Any] | tuple[str, int, int] | None"]
#: resolve(segment, offset, nbytes, slot) -> a buffer of exactly nbytes; raises ProtocolError
Resolve = Callable[[str, int, int, int], Any]


def encode(msg: Message, frame_bytes: int = DEFAULT_FRAME_BYTES, *, sender: str | None = None,
           rid: int | None = None, locate: Locate | None = None, job_token: str | None = None,
           limits: Limits | None = None) -> list[Any]:
    """Encode ``msg`` as ``[header, *tensor frames]`` without copying tensor payloads.

    ``sender``, ``rid`` and ``job_token``, when given, replace the message's own in the header (what
    ``msg.replace(sender=..., rid=...)`` would do, without building a new message). ``locate``,
    when given, is asked for each non-empty tensor: a ``[segment, offset, slot]`` it returns goes
    in the tensor's descriptor instead of frames (module docstring).

    ``limits``, when given, are checked before anything is sent: a message a receiver with these
    limits would refuse (tensor bytes, tensor count, rank, frame count, header size) raises
    ``ProtocolError`` with code ``too_large`` naming the field and the limit.
    """
    if frame_bytes <= 0:
        raise ValueError("frame_bytes must be positive")
    schema = _BY_CLASS.get(type(msg)) or _BY_WIRE[msg.kind.value]
    # msgpack packs tuples as arrays, so scalar values go in as they are.
    fields = {name: getattr(msg, name) for name in schema.scalars}
    descs: list[dict[str, Any]] = []
    frames: list[Any] = []
    total = 0  # tensor bytes so far (counted only against limits)
    for spec in schema.tensor_fields:
        value = getattr(msg, spec.name)
        values = value if spec.many else (value,)
        if spec.many and not isinstance(values, (tuple, list)):
            raise ProtocolError(f"{schema.wire}.{spec.name}: expected a sequence of tensors", "bad_field")
        for i, v in enumerate(values):
            t = _as_tensor(v, f"{schema.wire}.{spec.name}[{i}]")
            if limits is not None:
                total = _check_send_tensor(t, f"{schema.wire}.{spec.name}[{i}]", total, limits)
            if locate is not None and t.numel():
                ref = locate(t)
                if ref is not None:
                    descs.append({"field": spec.name, "dtype": _WIRE_NAME[t.dtype], "shape": list(t.shape),
                                  "frames": 0, "shm": [str(ref[0]), int(ref[1]), int(ref[2])]})
                    continue
            parts = _frames_of(t, frame_bytes)
            descs.append({"field": spec.name, "dtype": _WIRE_NAME[t.dtype], "shape": list(t.shape),
                          "frames": len(parts)})
            frames.extend(parts)
    header = {"version": PROTOCOL_VERSION, "kind": schema.wire,
              "sender": msg.sender if sender is None else sender, "rid": msg.rid if rid is None else rid,
              "fields": fields, "tensors": descs}
    token = msg.job_token if job_token is None else job_token
    if token:
        header["job_token"] = token
    packed = _packers.packer.pack(header)
    if limits is not None:
        _check_send_counts(schema.wire, descs, len(frames), len(packed), frame_bytes, limits)
    return [packed, *frames]


def _check_send_tensor(t: torch.Tensor, where: str, total: int, limits: Limits) -> int:
    """Refuse one tensor a receiver with ``limits`` would refuse; returns the message's bytes so far."""
    if t.dim() > limits.max_rank:
        raise ProtocolError(f"{where}: rank {t.dim()} exceeds the limit of {limits.max_rank} (limits.max_rank)",
                            "too_large")
    total += t.numel() * t.element_size()
    if total > limits.max_message_bytes:
        raise ProtocolError(f"{where}: the message's tensors reach {total} bytes, over the limit of "
                            f"{limits.max_message_bytes} (limits.max_message_bytes); send them in several messages "
                            "or raise the limit on both sides", "too_large")
    return total


def _check_send_counts(wire: str, descs: list[dict[str, Any]], nframes: int, header_bytes: int, frame_bytes: int,
                       limits: Limits) -> None:
    """Refuse a whole message a receiver with ``limits`` would refuse (counts and header size)."""
    if len(descs) > limits.max_tensors:
        raise ProtocolError(f"{wire}: {len(descs)} tensors exceed the limit of {limits.max_tensors} "
                            "(limits.max_tensors)", "too_large")
    if nframes > limits.max_frames:
        raise ProtocolError(f"{wire}: {nframes} data frames of at most {frame_bytes} bytes exceed the limit of "
                            f"{limits.max_frames} (limits.max_frames); raise frame_bytes or the limit",
                            "too_large")
    if header_bytes > limits.max_header_bytes:
        raise ProtocolError(f"{wire}: a header of {header_bytes} bytes exceeds the limit of "
                            f"{limits.max_header_bytes}", "too_large")


def message_tensors(msg: Message) -> list[torch.Tensor]:
    """The tensors of ``msg``'s tensor fields, in wire order (what ``encode`` would send)."""
    schema = _BY_CLASS.get(type(msg)) or _BY_WIRE[msg.kind.value]
    out: list[torch.Tensor] = []
    for spec in schema.tensor_fields:
        value = getattr(msg, spec.name)
        if spec.many:
            out.extend(v for v in value if isinstance(v, torch.Tensor))
        elif isinstance(value, torch.Tensor):
            out.append(value)
    return out


# ----------------------------------------------------------------------------- decode

def _buffer(frame: Any) -> memoryview:
    if type(frame) is bytes:  # the header, as the endpoints receive it: skip the attribute probe
        return memoryview(frame)
    # zmq.Frame exposes .buffer; bytes, bytearray and memoryview are buffers themselves.
    buf = getattr(frame, "buffer", frame)
    try:
        mv = memoryview(buf)
    except TypeError:
        raise ProtocolError(f"frame of type {type(frame).__name__} is not a buffer") from None
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


class _TooManyContainers(Exception):
    """Raised by the unpacking hooks of :func:`decode_header` (internal)."""


def _container_counter(limit: int) -> Callable[[Any], Any]:
    """An msgpack ``list_hook``/``object_hook`` that aborts the unpacking after ``limit`` containers."""
    left = limit

    def count(container: Any) -> Any:
        nonlocal left
        left -= 1
        if left < 0:
            raise _TooManyContainers
        return container
    return count


def decode_header(frame0: Any, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Parse and check frame 0's envelope (version, kind, sender, rid, fields, tensors types)."""
    raw = _buffer(frame0)
    if len(raw) > limits.max_header_bytes:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds the limit of {limits.max_header_bytes}", "too_large")
    options = dict(raw=False, strict_map_key=True, use_list=True, max_bin_len=limits.max_header_bytes,
                   max_str_len=limits.max_string, max_array_len=limits.max_tensors * 8 + 1024,
                   max_map_len=limits.max_tensors + 1024)
    containers = limits.container_limit
    if len(raw) > containers:
        # Each map or array takes at least one byte, so only a header longer than the limit can
        # hold too many: count them as they are built (the hook's cost per container is paid
        # by large headers only) and stop at the first one over.
        options["list_hook"] = options["object_hook"] = _container_counter(containers)
    try:
        header = msgpack.unpackb(raw, **options)
    except _TooManyContainers:
        raise ProtocolError(f"header holds more than {containers} maps and arrays (the limit)", "too_large") from None
    except Exception as exc:  # msgpack raises many types (ValueError, ExtraData, FormatError, ...)
        text = str(exc)
        if "exceeds max" in text:  # a string, binary, array or map over the header's limits
            raise ProtocolError(f"header: {text}", "too_large") from None
        if "not allowed for map key" in text:
            raise ProtocolError(f"header: map keys must be strings ({text})") from None
        raise ProtocolError(f"header is not valid msgpack: {exc.__class__.__name__}: {text}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}")
    missing = HEADER_KEYS - header.keys()
    extra = header.keys() - HEADER_KEYS - OPTIONAL_HEADER_KEYS
    if missing or extra:
        missing, extra = sorted(missing), sorted(extra, key=str)
        raise ProtocolError(f"header keys: missing {missing}, unexpected {extra}")
    if not isinstance(header.get("job_token", ""), str):
        raise ProtocolError("header.job_token must be a string")
    if header["version"] != PROTOCOL_VERSION or isinstance(header["version"], bool):
        raise ProtocolError(f"protocol version {header['version']!r} not supported; expected {PROTOCOL_VERSION}",
                            "bad_version")
    kind = header["kind"]
    if not isinstance(kind, str):
        raise ProtocolError("header.kind must be a string")
    if kind not in _BY_WIRE:
        raise ProtocolError(f"unknown kind {kind[:64]!r}", "unknown_kind")
    rid = header["rid"]
    if not isinstance(rid, int) or isinstance(rid, bool) or not 0 <= rid <= MAX_RID:
        raise ProtocolError("header.rid must be an unsigned 64-bit integer")
    if not isinstance(header["sender"], str):
        raise ProtocolError("header.sender must be a string")
    if not isinstance(header["fields"], dict):
        raise ProtocolError("header.fields must be a map")
    if not isinstance(header["tensors"], list):
        raise ProtocolError("header.tensors must be an array")
    if len(header["tensors"]) > limits.max_tensors:
        raise ProtocolError(f"{len(header['tensors'])} tensors exceed the limit of {limits.max_tensors}", "too_large")
    return header


def _view(frames: Sequence[memoryview], dtype: torch.dtype, shape: list[int], nbytes: int) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if len(frames) == 1:
        flat = torch.frombuffer(frames[0], dtype=dtype)  # a view: no copy
        return flat if len(shape) == 1 else flat.view(shape)
    # Split over several frames (separate allocations): assemble once into one buffer. numpy's
    # allocator asks the kernel for transparent huge pages on buffers this large, so first touch
    # costs 512x fewer page faults than torch.empty's 4 KiB pages (docs/protocol.md, "Flow control").
    out = np.empty(nbytes, dtype=np.uint8)
    pos = 0
    for f in frames:
        out[pos:pos + len(f)] = np.frombuffer(f, dtype=np.uint8)
        pos += len(f)
    return torch.from_numpy(out).view(dtype).view(shape)


def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS, *, resolve: Resolve | None = None) -> Message:
    """Decode ``[header, *tensor frames]`` into its typed message; raises only ProtocolError.

    ``resolve`` turns the shared-memory references of the header into buffers (module docstring);
    without one, a message holding a reference is refused (``bad_shm``)."""
    try:
        return _decode(frames, limits, resolve)
    except ProtocolError:
        raise
    except Exception as exc:  # a bug-shaped hole must still surface as a protocol error
        raise ProtocolError(f"undecodable message: {exc.__class__.__name__}: {exc}") from None


def _shm_view(where: str, ref: Any, wire_dtype: str, dtype: torch.dtype, shape: list[int], nbytes: int,
              nframes: int, resolve: Resolve | None) -> torch.Tensor:
    """The tensor a descriptor's ``shm`` reference names, as a view over the resolver's buffer."""
    if not (isinstance(ref, list) and len(ref) == 3 and isinstance(ref[0], str)
            and all(type(x) is int for x in ref[1:]) and ref[1] >= 0 and ref[2] >= 0):
        raise ProtocolError(f"{where}: shm must be [segment (str), offset (int >= 0), slot (int >= 0)]", "bad_shm")
    if nframes != 0:
        raise ProtocolError(f"{where}: a tensor in shared memory has frames = 0, got {nframes}", "bad_shm")
    if nbytes == 0:
        raise ProtocolError(f"{where}: an empty tensor travels inline, not in shared memory", "bad_shm")
    segment, offset, slot = ref
    if offset % _ITEMSIZE[wire_dtype]:
        raise ProtocolError(f"{where}: offset {offset} is not a multiple of the {wire_dtype} item size", "bad_shm")
    if resolve is None:
        raise ProtocolError(f"{where}: a shared-memory reference, but no shared memory was agreed with this peer",
                            "bad_shm")
    buf = resolve(segment, offset, nbytes, slot)
    if len(memoryview(buf).cast("B")) != nbytes:
        raise ProtocolError(f"{where}: shared-memory buffer of the wrong size", "bad_shm")
    flat = torch.frombuffer(buf, dtype=dtype)  # a view of the shared segment: no copy
    return flat if len(shape) == 1 else flat.view(shape)


def _decode(frames: Sequence[Any], limits: Limits, resolve: Resolve | None = None) -> Message:
    if len(frames) == 0:
        raise ProtocolError("empty message: no header frame")
    if len(frames) - 1 > limits.max_frames:
        raise ProtocolError(f"{len(frames) - 1} data frames exceed the limit of {limits.max_frames}", "too_large")
    header = decode_header(frames[0], limits)
    schema = _BY_WIRE[header["kind"]]
    wire = schema.wire

    values: dict[str, Any] = {"sender": header["sender"], "rid": header["rid"],
                              "job_token": header.get("job_token", "")}
    checkers = schema.checkers
    for name, value in header["fields"].items():
        check = checkers.get(name) if isinstance(name, str) else None
        if check is None:
            raise ProtocolError(f"{wire}: unexpected field {str(name)[:64]!r}", "bad_field")
        try:
            values[name] = check(value, limits)
        except _Mismatch as exc:
            raise _field_error(f"{wire}.{name}", exc) from None
        except _TooDeep as exc:
            raise ProtocolError(f"{wire}.{name}: {exc}", "too_large") from None
    for name in schema.required:
        if name not in values:
            raise ProtocolError(f"{wire}: missing field {name!r}", "bad_field")

    descs = header["tensors"]
    if not descs and len(frames) > 1:
        raise ProtocolError(f"{len(frames) - 1} data frames not described by the header")
    if not descs and not schema.tensor_fields:
        return schema.cls(**values)

    data = [_buffer(f) for f in frames[1:]]
    tensors: dict[str, list[torch.Tensor]] = {}
    pos = 0
    total = 0
    specs = schema.specs
    max_rank = limits.max_rank
    # Per descriptor: exact type tests (``type(x) is int`` also refuses bool) and no where-string
    # until something is wrong: up to max_tensors descriptors pass here per message.
    for i, desc in enumerate(descs):
        if type(desc) is not dict or (desc.keys() != TENSOR_KEYS and desc.keys() != TENSOR_KEYS_SHM):
            raise ProtocolError(f"{wire}.tensors[{i}]: expected a map with keys {sorted(TENSOR_KEYS)} "
                                "(and optionally 'shm')")
        field = desc["field"]
        spec = specs.get(field) if type(field) is str else None
        if spec is None or not spec.tensor:
            raise ProtocolError(f"{wire}.tensors[{i}]: {field!r} is not a tensor field of {wire}", "bad_field")
        wire_dtype = desc["dtype"]
        dtype = DTYPES.get(wire_dtype) if type(wire_dtype) is str else None
        if dtype is None:
            raise ProtocolError(f"{wire}.tensors[{i}]: unknown dtype {wire_dtype!r}; expected one of "
                                f"{sorted(DTYPES)}", "bad_dtype")
        shape = desc["shape"]
        if type(shape) is not list or len(shape) > max_rank or not all(type(d) is int and d >= 0 for d in shape):
            if type(shape) is list and len(shape) > max_rank:
                raise ProtocolError(f"{wire}.tensors[{i}]: rank {len(shape)} exceeds the limit of {max_rank}",
                                    "too_large")
            raise ProtocolError(f"{wire}.tensors[{i}]: shape must be an array of non-negative integers")
        nframes = desc["frames"]
        if type(nframes) is not int or nframes < 0:
            raise ProtocolError(f"{wire}.tensors[{i}]: frames must be a non-negative integer")
        itemsize = _ITEMSIZE[wire_dtype]
        nbytes = math.prod(shape) * itemsize
        if nbytes == 0 and math.prod(max(d, 1) for d in shape) * itemsize > limits.max_message_bytes:
            # empty, but its other dimensions would overflow torch's stride arithmetic
            raise ProtocolError(f"{wire}.tensors[{i}]: shape {shape} exceeds the limit of {limits.max_message_bytes} "
                                "bytes even with its zero dimension taken as 1", "too_large")
        total += nbytes
        if total > limits.max_message_bytes:
            raise ProtocolError(f"tensor bytes exceed the limit of {limits.max_message_bytes}", "too_large")
        if "shm" in desc:
            tensors.setdefault(spec.name, []).append(
                _shm_view(f"{wire}.tensors[{i}]", desc["shm"], wire_dtype, dtype, shape, nbytes, nframes, resolve))
            continue
        if pos + nframes > len(data):
            raise ProtocolError(f"{wire}.tensors[{i}]: header names {nframes} frames but only {len(data) - pos} "
                                "remain")
        if nframes == 1:
            part = data[pos]
            pos += 1
            if len(part) != nbytes or nbytes == 0:
                raise ProtocolError(f"{wire}.tensors[{i}]: {len(part)} bytes in 1 frame, expected {nbytes} for "
                                    f"{wire_dtype}{shape}")
            flat = torch.frombuffer(part, dtype=dtype)  # a view: no copy
            tensors.setdefault(spec.name, []).append(flat if len(shape) == 1 else flat.view(shape))
            continue
        parts = data[pos:pos + nframes]
        pos += nframes
        got = sum(len(p) for p in parts)
        if got != nbytes or (nbytes > 0) != (nframes > 0):
            raise ProtocolError(f"{wire}.tensors[{i}]: {got} bytes in {nframes} frames, expected {nbytes} for "
                                f"{wire_dtype}{shape}")
        tensors.setdefault(spec.name, []).append(_view(parts, dtype, shape, nbytes))
    if pos != len(data):
        raise ProtocolError(f"{len(data) - pos} data frames not described by the header")

    for spec in schema.tensor_fields:
        got_t = tensors.get(spec.name, [])
        if spec.many:
            values[spec.name] = tuple(got_t)
        elif len(got_t) == 1:
            values[spec.name] = got_t[0]
        elif got_t or spec.required:
            raise ProtocolError(f"{wire}.{spec.name}: expected exactly one tensor, got {len(got_t)}",
                                "bad_field")
    return schema.cls(**values)


def frame_error_rid(frames: Sequence[Any]) -> int:
    """Best-effort request id of a message that failed to decode (0 if even that is unreadable)."""
    # Read the top-level map key by key and skip every value but rid's, so that what broke the
    # full decode (an over-long string, an integer map key, a bad tensor table) elsewhere in the
    # header does not hide the rid the error reply should carry.
    try:
        buf = _buffer(frames[0])
        n = max(len(buf), 1)
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=n, max_str_len=n,
                                    max_bin_len=n, max_array_len=n, max_map_len=n)
        unpacker.feed(buf)
        for _ in range(min(unpacker.read_map_header(), 64)):
            if unpacker.unpack() == "rid":
                rid = unpacker.unpack()
                return rid if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid <= MAX_RID else 0
            unpacker.skip()
        return 0
    except Exception:
        return 0
