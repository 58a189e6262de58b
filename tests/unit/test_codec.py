"""Pure codec tests: round trips of every dtype and shape, and decode's error contract."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hmp.errors import ProtocolError
from hmp.messages import (MESSAGE_TYPES, Ack, Assign, Error, Heartbeat, Join, Kind, Params, Pull, Push, Report,
                          RingInfo, Tensors, Welcome, WelcomeInfo, Work)
from hmp.transport.codec import DTYPES, Limits, decode, encode, frame_error_rid

SHAPES = [(), (0,), (3,), (2, 3), (4, 0, 2), (2, 1, 3, 1, 2), (1,) * 8]


def _sample(dtype: torch.dtype, shape) -> torch.Tensor:
    if dtype is torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, dtype=dtype)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_every_dtype_and_shape(dtype, shape):
    """Every supported dtype and shape (0-d, empty, rank 8) comes back bit-exact with its dtype and shape."""
    t = _sample(dtype, shape)
    out = decode(encode(Tensors(name="t", tensors=(t,))))
    (got,) = out.tensors
    assert got.dtype == dtype and tuple(got.shape) == shape
    assert got.reshape(-1).view(torch.uint8).tolist() == t.reshape(-1).view(torch.uint8).tolist()


@pytest.mark.parametrize("np_dtype", ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32",
                                      "float64"])
def test_numpy_arrays_travel_as_tensors(np_dtype):
    """numpy arrays (also non-contiguous ones) are accepted and arrive as equal torch tensors."""
    a = (np.arange(24).reshape(4, 6) % 3).astype(np_dtype)[:, ::2]
    (got,) = decode(encode(Tensors(name="a", tensors=(a,)))).tensors
    np.testing.assert_array_equal(got.numpy(), a)


def test_single_frame_tensor_is_a_view_over_the_frame():
    """A tensor that fits one frame is decoded as a view over the received buffer, not a copy."""
    frames = [bytes(f) for f in encode(Tensors(name="x", tensors=(torch.arange(10, dtype=torch.float32),)))]
    frames[1] = bytearray(frames[1])
    (got,) = decode(frames).tensors
    frames[1][0:4] = np.float32(42.0).tobytes()
    assert got[0].item() == 42.0


def test_send_side_frames_alias_the_tensor():
    """encode() returns views of the tensor's memory (zero-copy send), cut at frame_bytes."""
    t = torch.zeros(1000, dtype=torch.float32)
    frames = encode(Tensors(name="x", tensors=(t,)), frame_bytes=1024)
    assert [len(memoryview(f)) for f in frames[1:]] == [1024, 1024, 1024, 928]
    t[0] = 1.0
    assert np.frombuffer(frames[1], dtype=np.float32)[0] == 1.0


def test_large_tensor_split_into_frames_round_trips():
    """A tensor larger than the frame size spans several frames and is reassembled bit-exact."""
    t = torch.randn(3 * 1024 * 1024 // 4 + 7)
    frames = encode(Tensors(name="x", tensors=(t,)), frame_bytes=1 << 20)
    assert len(frames) == 1 + 4
    assert torch.equal(decode(frames).tensors[0], t)


def test_cuda_tensor_requires_explicit_move():
    """A tensor not on the CPU is refused with a clear error rather than silently copied."""
    t = torch.zeros(2, device="meta")
    with pytest.raises(ProtocolError, match="move it to the CPU"):
        encode(Tensors(name="x", tensors=(t,)))


def test_short_reprs_for_logs():
    """Messages print short, log-friendly reprs without tensor contents."""
    r = repr(Push(sender="W[0]", rid=5, keys=(1, 2), grads=(torch.zeros(4), torch.zeros(2))))
    assert r == "W[0] push #5 keys=(1, 2) grads=[2 tensors, 24 B] version=0 samples=0"
    assert Kind.HEARTBEAT.is_control and not Kind.PUSH.is_control


# ----------------------------------------------------------------------------- property tests

_text = st.text(max_size=20)
_scalar_for = {
    int: st.integers(min_value=-(2**63), max_value=2**63 - 1), float: st.floats(allow_nan=False),
    str: _text, bool: st.booleans(),
}
_tensor = st.builds(
    lambda dtype, shape, seed: _sample_seeded(dtype, shape, seed),
    st.sampled_from(list(DTYPES.values())),
    st.lists(st.integers(0, 4), max_size=4).map(tuple),
    st.integers(0, 2**16),
)


def _sample_seeded(dtype, shape, seed):
    torch.manual_seed(seed)
    return _sample(dtype, shape)


_json = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | _text,
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(_text, c, max_size=3), max_leaves=8)

_messages = st.one_of(
    st.builds(Push, sender=_text, rid=st.integers(0, 2**64 - 1), keys=st.lists(st.integers(0, 2**31)).map(tuple),
              grads=st.lists(_tensor, max_size=4).map(tuple), version=_scalar_for[int], samples=_scalar_for[int]),
    st.builds(Params, keys=st.lists(st.integers(0, 100)).map(tuple), values=st.lists(_tensor, max_size=3).map(tuple)),
    st.builds(Pull, keys=st.lists(st.integers(0, 100)).map(tuple)),
    st.builds(Tensors, name=_text, tensors=st.lists(_tensor, max_size=3).map(tuple), step=_scalar_for[int],
              meta=st.dictionaries(_text, _json, max_size=3)),
    st.builds(Report, metrics=st.dictionaries(_text, _scalar_for[float], max_size=5), done=st.booleans()),
    st.builds(Assign, batch_size=_scalar_for[int], data_share=_scalar_for[float], stop=st.booleans()),
    st.builds(Join, role=_text, address=_text, pid=_scalar_for[int]),
    st.builds(Welcome, heartbeat_interval_s=_scalar_for[float], info=st.builds(
        WelcomeInfo, shards=st.lists(st.tuples(_text, _text), max_size=3).map(tuple),
        workers=st.none() | st.lists(_text, max_size=3).map(tuple), batch_size=st.none() | _scalar_for[int],
        resume=st.none() | st.dictionaries(_text, _scalar_for[float], max_size=3),
        ring=st.none() | st.builds(RingInfo, generation=_scalar_for[int], members=st.lists(_text, max_size=3).map(tuple),
                                   addresses=st.lists(_text, max_size=3).map(tuple), rank=_scalar_for[int]))),
    st.builds(Work, count=_scalar_for[int], epoch=_scalar_for[int], start=_scalar_for[int]),
    st.builds(Error, code=_text, message=_text), st.builds(Ack, detail=_text), st.builds(Heartbeat, step=_scalar_for[int]),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_messages, st.integers(1, 64))
def test_decode_inverts_encode(msg, frame_bytes):
    """decode(encode(m)) == m for generated messages of every shape, at any frame size."""
    assert decode(encode(msg, frame_bytes=frame_bytes)) == msg


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=5))
def test_random_frames_raise_only_protocol_error(frames):
    """Arbitrary bytes never make decode raise anything but ProtocolError."""
    try:
        decode(frames)
    except ProtocolError:
        pass


@settings(max_examples=400, deadline=None)
@given(_messages, st.data())
def test_mutated_real_messages_raise_only_protocol_error(msg, data):
    """Truncated, extended, reordered or bit-flipped real messages decode or raise ProtocolError, nothing else."""
    frames = [bytes(memoryview(f)) for f in encode(msg, frame_bytes=8)]
    op = data.draw(st.sampled_from(["truncate_frames", "drop_frame", "extra_frame", "flip", "cut_header", "swap"]))
    if op == "truncate_frames":
        frames = frames[: data.draw(st.integers(0, len(frames)))]
    elif op == "drop_frame" and len(frames) > 1:
        del frames[data.draw(st.integers(1, len(frames) - 1))]
    elif op == "extra_frame":
        frames.append(data.draw(st.binary(max_size=16)))
    elif op == "flip":
        i = data.draw(st.integers(0, len(frames) - 1))
        if frames[i]:
            j = data.draw(st.integers(0, len(frames[i]) - 1))
            b = bytearray(frames[i])
            b[j] ^= 1 << data.draw(st.integers(0, 7))
            frames[i] = bytes(b)
    elif op == "cut_header":
        frames[0] = frames[0][: data.draw(st.integers(0, len(frames[0])))]
    elif op == "swap" and len(frames) > 2:
        frames[1], frames[-1] = frames[-1], frames[1]
    try:
        decode(frames)
    except ProtocolError:
        pass


def _header(**over):
    h = {"version": 1, "kind": "pull", "sender": "x", "rid": 1, "fields": {"keys": [1]}, "tensors": []}
    h.update(over)
    return msgpack.packb(h)


@pytest.mark.parametrize(
    ("frames", "code", "match"),
    [
        ([b"\xc1"], "malformed", "not valid msgpack"),
        ([msgpack.packb([1, 2])], "malformed", "must be a map"),
        ([_header(version=2)], "bad_version", "version 2"),
        ([_header(kind="teleport")], "unknown_kind", "teleport"),
        ([_header(fields={})], "bad_field", "missing field 'keys'"),
        ([_header(fields={"keys": "abc"})], "bad_field", "expected tuple"),
        ([_header(fields={"keys": [1], "color": 3})], "bad_field", "unexpected field 'color'"),
        ([_header(rid=-1)], "malformed", "rid"),
        ([_header(kind="tensors", fields={"name": "a"}, tensors=[{"field": "tensors", "dtype": "complex64",
                                                                  "shape": [1], "frames": 1}]), b"12345678"],
         "bad_dtype", "complex64"),
        ([_header(kind="tensors", fields={"name": "a"}, tensors=[{"field": "tensors", "dtype": "float32",
                                                                  "shape": [3], "frames": 1}]), b"1234"],
         "malformed", "expected 12"),
        ([_header(kind="tensors", fields={"name": "a"}, tensors=[{"field": "tensors", "dtype": "float32",
                                                                  "shape": [1] * 9, "frames": 1}]), b"1234"],
         "too_large", "rank 9"),
        ([_header(kind="tensors", fields={"name": "a"}, tensors=[]), b"stray"], "malformed", "not described"),
    ],
)
def test_malformed_headers_name_the_problem(frames, code, match):
    """Each kind of malformed header is refused with its error code and a message naming the problem."""
    with pytest.raises(ProtocolError, match=match) as info:
        decode(frames)
    assert info.value.code == code


def test_limits_are_enforced():
    """Messages over the configured frame, byte or rank limits are refused as too_large."""
    msg = Tensors(name="x", tensors=(torch.zeros(64),))
    with pytest.raises(ProtocolError) as info:
        decode(encode(msg, frame_bytes=16), Limits(max_frames=8))
    assert info.value.code == "too_large"
    with pytest.raises(ProtocolError) as info:
        decode(encode(msg), Limits(max_message_bytes=100))
    assert info.value.code == "too_large"


def test_every_kind_is_registered():
    """Every Kind has exactly one message class."""
    assert set(MESSAGE_TYPES) == set(Kind)


# ----------------------------------------------------------------------------- fast paths

def test_encode_can_override_sender_and_rid():
    """encode(msg, sender=, rid=) gives the same frames as encoding msg.replace(sender=, rid=)."""
    msg = Push(sender="W[0]", rid=3, keys=(1,), grads=(torch.ones(2),), version=4)
    got = [bytes(memoryview(f)) for f in encode(msg, sender="S[1]", rid=99)]
    want = [bytes(memoryview(f)) for f in encode(msg.replace(sender="S[1]", rid=99))]
    assert got == want
    assert decode(got).rid == 99 and decode(got).sender == "S[1]"


def test_large_tensor_is_one_frame_and_a_view_by_default():
    """With the default frame size a 4 MiB tensor is one frame and decodes as a view over it (no copy)."""
    t = torch.zeros(1 << 20, dtype=torch.float32)
    frames = encode(Tensors(name="x", tensors=(t,)))
    assert len(frames) == 2
    data = bytearray(memoryview(frames[1]))
    (got,) = decode([frames[0], data]).tensors
    data[4:8] = np.float32(5.0).tobytes()
    assert got[1].item() == 5.0


def test_tensor_split_over_frames_owns_its_memory():
    """A tensor assembled from several frames is a copy: later changes to the frames do not reach it."""
    t = torch.arange(64, dtype=torch.int64)
    frames = [bytearray(memoryview(f)) for f in encode(Tensors(name="x", tensors=(t,)), frame_bytes=100)]
    (got,) = decode(frames).tensors
    frames[1][0:8] = (12345).to_bytes(8, "little")
    assert torch.equal(got, t)


@pytest.mark.parametrize(
    ("kind", "fields", "match"),
    [
        ("pull", {"keys": [1, "x"]}, r"pull\.keys\[1\]: expected int, got str"),
        ("report", {"metrics": {"a": "x"}}, r"report\.metrics\['a'\]: expected float, got str"),
        ("report", {"metrics": {b"k": 1.0}}, r"report\.metrics key: expected str, got bytes"),
        ("assign", {"batch_size": True}, r"assign\.batch_size: expected int, got bool"),
        ("report", {"metrics": {}, "done": 1}, r"report\.done: expected bool, got int"),
    ],
)
def test_bad_field_values_name_their_path(kind, fields, match):
    """A wrongly typed header value, also inside a list or map, is refused as bad_field naming where it sits."""
    with pytest.raises(ProtocolError, match=match) as info:
        decode([_header(kind=kind, fields=fields)])
    assert info.value.code == "bad_field"


def _header(**kw) -> bytes:
    h = {"version": 1, "kind": "pull", "sender": "w", "rid": 7, "fields": {"keys": [0]}, "tensors": []}
    h.update(kw)
    return msgpack.packb(h)


@pytest.mark.parametrize("frames, code", [
    ([_header(sender="x" * 70000)], "too_large"),  # over max_string
    ([_header(fields={1: 2})], "malformed"),  # an integer map key
])
def test_header_errors_get_their_code_and_keep_the_rid(frames, code):
    """What breaks the full header decode still leaves the rid readable for the error reply."""
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    assert info.value.code == code
    assert frame_error_rid(frames) == 7


def test_empty_tensor_with_overflowing_dimensions_is_too_large():
    header = msgpack.packb({"version": 1, "kind": "push", "sender": "w", "rid": 9,
                            "fields": {"keys": [0], "samples": 0, "version": 0},
                            "tensors": [{"field": "grads", "dtype": "float32", "shape": [0, 2**62, 2**62],
                                         "frames": 0}]})
    with pytest.raises(ProtocolError) as info:
        decode([header])
    assert info.value.code == "too_large" and "shape" in str(info.value)


# ----------------------------------------------------------------------------- expensive messages

def _tensors_header(**kw) -> bytes:
    h = {"version": 1, "kind": "tensors", "sender": "w", "rid": 7, "fields": {"name": "a"}, "tensors": []}
    h.update(kw)
    return msgpack.packb(h)


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize(("frames", "match"), [
    # a header of a million empty arrays: refused by the container count, not unpacked whole
    ([_tensors_header(fields={"name": "a", "meta": {"x": [[[]] * 8000] * 120}})], "maps and arrays"),
    # descriptors over max_tensors, each with its (tiny) frame
    ([_tensors_header(tensors=[{"field": "tensors", "dtype": "uint8", "shape": [1], "frames": 1}] * 1025)]
     + [b"x"] * 1025, "1025 tensors exceed the limit of 1024"),
    # thousands of descriptors: stopped by the container count before max_tensors is even checked
    ([_tensors_header(tensors=[{"field": "tensors", "dtype": "uint8", "shape": [0], "frames": 0}] * 5000)],
     "maps and arrays"),
    ([_tensors_header(fields={"name": "a", "meta": {"x": _nested(33)}})], r"tensors\.meta: nested deeper than"),
    ([_tensors_header(sender="s" * 70000)], "max_str_len"),
    ([_tensors_header()] + [b""] * 4097, "4097 data frames exceed"),
])
def test_expensive_messages_are_refused_as_too_large(frames, match):
    """Messages whose decoding would cost more than their bytes (many containers, descriptors or frames, deep
    nesting, long strings) are refused as too_large, naming what was over which limit."""
    with pytest.raises(ProtocolError, match=match) as info:
        decode(frames)
    assert info.value.code == "too_large"
    assert frame_error_rid(frames) == 7


def test_values_at_the_limits_still_decode():
    """Exactly max_tensors descriptors, nesting of exactly max_depth and a header of exactly max_containers
    maps and arrays are accepted: the limits refuse only what is over them."""
    n = Limits().max_tensors
    msg = Tensors(name="a", tensors=tuple(torch.full((1,), i % 256, dtype=torch.uint8) for i in range(n)),
                  meta={"x": _nested(Limits().max_depth)})
    assert decode(encode(msg)) == msg
    limits = Limits(max_containers=100)
    # the header, fields, meta, meta's list and the tensor table: 5 containers, plus 95 empty arrays
    fits = _tensors_header(fields={"name": "a", "meta": {"x": [[]] * 95}})
    decode([fits], limits)
    over = _tensors_header(fields={"name": "a", "meta": {"x": [[]] * 96}})
    with pytest.raises(ProtocolError, match="more than 100 maps and arrays"):
        decode([over], limits)


def test_custom_limits_raise_the_tensor_and_container_caps_together():
    """max_containers follows max_tensors unless set: raising max_tensors admits that many descriptors."""
    msg = Tensors(name="a", tensors=tuple(torch.zeros(1) for _ in range(3000)))
    with pytest.raises(ProtocolError, match="maps and arrays"):
        decode(encode(msg))
    assert len(decode(encode(msg), Limits(max_tensors=4096)).tensors) == 3000


@pytest.mark.parametrize(("msg", "kw", "limits", "match"), [
    (Tensors(name="a", tensors=(torch.zeros(100, dtype=torch.uint8), torch.zeros(29, dtype=torch.uint8))), {},
     Limits(max_message_bytes=128), r"tensors\.tensors\[1\]: the message's tensors reach 129 bytes, over the limit "
                                    r"of 128 \(limits\.max_message_bytes\)"),
    (Tensors(name="a", tensors=(torch.zeros((1,) * 9),)), {}, Limits(),
     r"tensors\.tensors\[0\]: rank 9 exceeds the limit of 8 \(limits\.max_rank\)"),
    (Tensors(name="a", tensors=tuple(torch.zeros(1) for _ in range(5))), {}, Limits(max_tensors=4),
     r"tensors: 5 tensors exceed the limit of 4 \(limits\.max_tensors\)"),
    (Tensors(name="a", tensors=(torch.zeros(100, dtype=torch.uint8),)), {"frame_bytes": 10}, Limits(max_frames=9),
     r"tensors: 10 data frames of at most 10 bytes exceed the limit of 9 \(limits\.max_frames\)"),
    (Tensors(name="a", tensors=(), meta={"x": "y" * 2000}), {}, Limits(max_header_bytes=1000),
     "header of 20.. bytes exceeds the limit of 1000"),
])
def test_encode_with_limits_refuses_on_the_sender_side(msg, kw, limits, match):
    """encode(..., limits=) raises too_large naming the field and the limit for what a receiver with the same
    limits would refuse; without limits the same message encodes (and the receiver refuses it)."""
    with pytest.raises(ProtocolError, match=match) as info:
        encode(msg, limits=limits, **kw)
    assert info.value.code == "too_large"
    with pytest.raises(ProtocolError) as info:
        decode(encode(msg, **kw), limits)
    assert info.value.code == "too_large"


def test_encode_with_limits_passes_what_fits():
    """A message at every limit encodes with limits= exactly as without."""
    msg = Tensors(name="a", tensors=(torch.zeros(64, dtype=torch.uint8),) * 4)
    limits = Limits(max_message_bytes=256, max_tensors=4, max_frames=8)
    got = encode(msg, frame_bytes=32, limits=limits)
    assert [bytes(memoryview(f)) for f in got] == [bytes(memoryview(f)) for f in encode(msg, frame_bytes=32)]
    assert decode(got, limits) == msg


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.integers(0, 9) | st.text(max_size=3),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=3), c, max_size=4),
                    max_leaves=40), st.integers(1, 6))
def test_depth_limit_matches_the_nesting(value, max_depth):
    """A free-form value (here a value in tensors.meta) decodes exactly when its nesting (a scalar: 0, [] or {}:
    1) is within max_depth."""
    def depth(v):
        if isinstance(v, list):
            return 1 + max((depth(x) for x in v), default=0)
        if isinstance(v, dict):
            return 1 + max((depth(x) for x in v.values()), default=0)
        return 0
    frames = encode(Tensors(name="a", tensors=(), meta={"v": value}))
    limits = Limits(max_depth=max_depth)
    if depth(value) <= max_depth:
        assert decode(frames, limits).meta == {"v": value}
    else:
        with pytest.raises(ProtocolError, match="nested deeper") as info:
            decode(frames, limits)
        assert info.value.code == "too_large"
