"""The wire codec: pure functions between typed messages and frame lists. No sockets here.

``encode(msg) -> list[buffer]`` and ``decode(frames) -> Message``. Frame 0 is a msgpack map (the
header); frames 1..n are raw C-contiguous tensor bytes, each tensor cut into frames of at most
``frame_bytes``. The full format is in docs/protocol.md.

Zero-copy rules
---------------
* ``encode`` returns memoryviews over the tensors' own memory; nothing is copied unless a tensor
  is not C-contiguous (made contiguous once: the wire carries dense row-major bytes). The caller
  must not mutate a tensor until the send that holds its frames has completed (see
  ``Endpoint.send``: ``track=True`` returns a tracker to wait on).
* ``decode`` returns tensors that are *views over the received frames* when a tensor arrived in
  one frame (the PS data path keeps every chunk within one frame for this reason). The views are
  read-only in spirit: they alias the transport's receive buffers. A tensor that arrived split
  over several frames is assembled into one new buffer: the frames are separate allocations, and
  one contiguous tensor cannot view them all (this is the only copy on the receive side).
* ``decode`` raises only :class:`~hmp.errors.ProtocolError`, whatever bytes it is given.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from hmp.errors import ProtocolError
from hmp.messages import MESSAGE_TYPES, PROTOCOL_VERSION, SCHEMAS, FieldSpec, Kind, Message

# Received frames are read-only buffers; torch warns on every frombuffer over one. The views are
# documented as read-only, so the warning carries no information here.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

DEFAULT_FRAME_BYTES = 1 << 20

#: wire dtype name -> torch dtype. bfloat16 has no numpy twin and travels as its raw bytes.
DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float32": torch.float32, "float64": torch.float64,
}
_WIRE_NAME = {v: k for k, v in DTYPES.items()}
HEADER_KEYS = frozenset({"version", "kind", "sender", "rid", "fields", "tensors"})
TENSOR_KEYS = frozenset({"field", "dtype", "shape", "frames"})
MAX_RID = (1 << 64) - 1


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """Bounds every decoded message must respect (config ``[limits]``)."""

    max_frames: int = 4096  #: data frames per message
    max_message_bytes: int = 1 << 30  #: tensor bytes per message
    max_header_bytes: int = 1 << 20
    max_tensors: int = 4096
    max_rank: int = 8
    max_string: int = 1 << 16  #: characters in any header string


DEFAULT_LIMITS = Limits()


# ----------------------------------------------------------------------------- encode

def _as_tensor(value: Any, where: str) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise ProtocolError(f"{where}: unsupported numpy dtype {value.dtype}", "bad_dtype")
        # Not C-contiguous: made contiguous once, because the wire carries dense row-major bytes.
        value = torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise ProtocolError(f"{where}: expected a tensor, got {type(value).__name__}", "bad_field")
    if value.device.type != "cpu":
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
    # A byte view of the tensor's own storage; the numpy array keeps the tensor alive.
    whole = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    return [whole[i:i + frame_bytes] for i in range(0, nbytes, frame_bytes)]


def encode(msg: Message, frame_bytes: int = DEFAULT_FRAME_BYTES) -> list[Any]:
    """Encode ``msg`` as ``[header, *tensor frames]`` without copying tensor payloads."""
    if frame_bytes <= 0:
        raise ValueError("frame_bytes must be positive")
    fields: dict[str, Any] = {}
    descs: list[dict[str, Any]] = []
    frames: list[Any] = []
    for spec in SCHEMAS[msg.kind]:
        value = getattr(msg, spec.name)
        if not spec.tensor:
            fields[spec.name] = list(value) if isinstance(value, tuple) else value
            continue
        values = value if spec.many else (value,)
        if spec.many and not isinstance(values, (tuple, list)):
            raise ProtocolError(f"{msg.kind.value}.{spec.name}: expected a sequence of tensors", "bad_field")
        for i, v in enumerate(values):
            t = _as_tensor(v, f"{msg.kind.value}.{spec.name}[{i}]")
            parts = _frames_of(t, frame_bytes)
            descs.append({"field": spec.name, "dtype": _WIRE_NAME[t.dtype], "shape": list(t.shape),
                          "frames": len(parts)})
            frames.extend(parts)
    header = {"version": PROTOCOL_VERSION, "kind": msg.kind.value, "sender": msg.sender, "rid": msg.rid,
              "fields": fields, "tensors": descs}
    return [msgpack.packb(header, use_bin_type=True), *frames]


# ----------------------------------------------------------------------------- decode

def _check_value(value: Any, ann: Any, where: str, limits: Limits) -> Any:
    """Check a header value against a field annotation; returns it as the dataclass wants it."""
    origin = getattr(ann, "__origin__", None)
    if ann is Any:
        return value
    if ann is bool:
        if isinstance(value, bool):
            return value
    elif ann is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif ann is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif ann is str:
        if isinstance(value, str) and len(value) <= limits.max_string:
            return value
    elif origin is tuple:
        if isinstance(value, (list, tuple)):
            item = ann.__args__[0]
            return tuple(_check_value(v, item, f"{where}[{i}]", limits) for i, v in enumerate(value))
    elif origin is dict:
        if isinstance(value, dict):
            kt, vt = ann.__args__
            return {_check_value(k, kt, f"{where} key", limits): _check_value(v, vt, f"{where}[{k!r}]", limits)
                    for k, v in value.items()}
    name = getattr(ann, "__name__", str(ann))
    raise ProtocolError(f"{where}: expected {name}, got {type(value).__name__}", "bad_field")


def _buffer(frame: Any) -> memoryview:
    # zmq.Frame exposes .buffer; bytes, bytearray and memoryview are buffers themselves.
    buf = getattr(frame, "buffer", frame)
    try:
        mv = memoryview(buf)
    except TypeError:
        raise ProtocolError(f"frame of type {type(frame).__name__} is not a buffer") from None
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def decode_header(frame0: Any, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Parse and check frame 0's envelope (version, kind, sender, rid, fields, tensors types)."""
    raw = _buffer(frame0)
    if len(raw) > limits.max_header_bytes:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds the limit of {limits.max_header_bytes}", "too_large")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True,
                                 max_bin_len=limits.max_header_bytes, max_str_len=limits.max_string,
                                 max_array_len=limits.max_tensors * 8 + 1024, max_map_len=limits.max_tensors + 1024)
    except Exception as exc:  # msgpack raises many types (ValueError, ExtraData, FormatError, ...)
        raise ProtocolError(f"header is not valid msgpack: {exc.__class__.__name__}: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}")
    if set(header) != HEADER_KEYS:
        missing, extra = sorted(HEADER_KEYS - set(header)), sorted(set(header) - HEADER_KEYS)
        raise ProtocolError(f"header keys: missing {missing}, unexpected {extra}")
    if header["version"] != PROTOCOL_VERSION or isinstance(header["version"], bool):
        raise ProtocolError(f"protocol version {header['version']!r} not supported; expected {PROTOCOL_VERSION}",
                            "bad_version")
    if not isinstance(header["kind"], str):
        raise ProtocolError("header.kind must be a string")
    try:
        Kind(header["kind"])
    except ValueError:
        raise ProtocolError(f"unknown kind {header['kind'][:64]!r}", "unknown_kind") from None
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
        return torch.frombuffer(frames[0], dtype=dtype).view(shape)  # a view: no copy
    # Split over several frames (separate allocations): assemble once into one buffer.
    out = torch.empty(nbytes, dtype=torch.uint8)
    dst = out.numpy()
    pos = 0
    for f in frames:
        dst[pos:pos + len(f)] = np.frombuffer(f, dtype=np.uint8)
        pos += len(f)
    return out.view(dtype).view(shape)


def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Decode ``[header, *tensor frames]`` into its typed message; raises only ProtocolError."""
    try:
        return _decode(frames, limits)
    except ProtocolError:
        raise
    except Exception as exc:  # a bug-shaped hole must still surface as a protocol error
        raise ProtocolError(f"undecodable message: {exc.__class__.__name__}: {exc}") from None


def _decode(frames: Sequence[Any], limits: Limits) -> Message:
    if len(frames) == 0:
        raise ProtocolError("empty message: no header frame")
    if len(frames) - 1 > limits.max_frames:
        raise ProtocolError(f"{len(frames) - 1} data frames exceed the limit of {limits.max_frames}", "too_large")
    header = decode_header(frames[0], limits)
    kind = Kind(header["kind"])
    schema: dict[str, FieldSpec] = {s.name: s for s in SCHEMAS[kind]}
    data = [_buffer(f) for f in frames[1:]]

    values: dict[str, Any] = {"sender": header["sender"], "rid": header["rid"]}
    fields = header["fields"]
    for name, value in fields.items():
        spec = schema.get(name) if isinstance(name, str) else None
        if spec is None or spec.tensor:
            raise ProtocolError(f"{kind.value}: unexpected field {str(name)[:64]!r}", "bad_field")
        values[name] = _check_value(value, spec.annotation, f"{kind.value}.{name}", limits)

    tensors: dict[str, list[torch.Tensor]] = {}
    pos = 0
    total = 0
    for i, desc in enumerate(header["tensors"]):
        where = f"{kind.value}.tensors[{i}]"
        if not isinstance(desc, dict) or set(desc) != TENSOR_KEYS:
            raise ProtocolError(f"{where}: expected a map with keys {sorted(TENSOR_KEYS)}")
        spec = schema.get(desc["field"]) if isinstance(desc["field"], str) else None
        if spec is None or not spec.tensor:
            raise ProtocolError(f"{where}: {desc['field']!r} is not a tensor field of {kind.value}", "bad_field")
        dtype = DTYPES.get(desc["dtype"]) if isinstance(desc["dtype"], str) else None
        if dtype is None:
            raise ProtocolError(f"{where}: unknown dtype {desc['dtype']!r}; expected one of {sorted(DTYPES)}",
                                "bad_dtype")
        shape = desc["shape"]
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise ProtocolError(f"{where}: shape must be an array of non-negative integers")
        if len(shape) > limits.max_rank:
            raise ProtocolError(f"{where}: rank {len(shape)} exceeds the limit of {limits.max_rank}", "too_large")
        nframes = desc["frames"]
        if not isinstance(nframes, int) or isinstance(nframes, bool) or nframes < 0:
            raise ProtocolError(f"{where}: frames must be a non-negative integer")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        total += nbytes
        if total > limits.max_message_bytes:
            raise ProtocolError(f"tensor bytes exceed the limit of {limits.max_message_bytes}", "too_large")
        if pos + nframes > len(data):
            raise ProtocolError(f"{where}: header names {nframes} frames but only {len(data) - pos} remain")
        parts = data[pos:pos + nframes]
        pos += nframes
        got = sum(len(p) for p in parts)
        if got != nbytes or (nbytes > 0) != (nframes > 0):
            raise ProtocolError(f"{where}: {got} bytes in {nframes} frames, expected {nbytes} for "
                                f"{desc['dtype']}{shape}")
        tensors.setdefault(spec.name, []).append(_view(parts, dtype, shape, nbytes))
    if pos != len(data):
        raise ProtocolError(f"{len(data) - pos} data frames not described by the header")

    for spec in schema.values():
        if spec.tensor:
            got_t = tensors.get(spec.name, [])
            if spec.many:
                values[spec.name] = tuple(got_t)
            elif len(got_t) == 1:
                values[spec.name] = got_t[0]
            elif got_t or spec.required:
                raise ProtocolError(f"{kind.value}.{spec.name}: expected exactly one tensor, got {len(got_t)}",
                                    "bad_field")
        elif spec.required and spec.name not in values:
            raise ProtocolError(f"{kind.value}: missing field {spec.name!r}", "bad_field")
    return MESSAGE_TYPES[kind](**values)


def frame_error_rid(frames: Sequence[Any]) -> int:
    """Best-effort request id of a message that failed to decode (0 if even that is unreadable)."""
    try:
        header = msgpack.unpackb(_buffer(frames[0]), raw=False, max_str_len=1024, max_bin_len=1024,
                                 max_array_len=1024, max_map_len=64)
        rid = header.get("rid", 0) if isinstance(header, dict) else 0
        return rid if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid <= MAX_RID else 0
    except Exception:
        return 0
