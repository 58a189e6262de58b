"""Typed message payloads (hmp.messages.WelcomeInfo and its parts): the map they travel as, and how a received
map that does not fit is refused."""

from __future__ import annotations

import msgpack
import pytest

from hmp.errors import ProtocolError
from hmp.messages import ReplicaInfo, RingInfo, Welcome, WelcomeInfo
from hmp.transport.codec import decode, encode


def _with_info(info: dict) -> list:
    """A welcome whose ``info`` map is ``info`` as it is, packed by hand (what any peer may send)."""
    header = {"version": 1, "kind": "welcome", "sender": "sched", "rid": 3,
              "fields": {"heartbeat_interval_s": 1.0, "info": info}, "tensors": []}
    return [msgpack.packb(header, use_bin_type=True)]


def test_a_worker_welcome_travels_as_the_map_it_always_was():
    """Set fields in declaration order, None fields left out: the same bytes as the untyped map."""
    info = WelcomeInfo(shards=(("ps0", "tcp://ps0"),), worker_index=1, num_workers=3, batch_size=32,
                       resume={"updates": 9.0}, start_epoch=0,
                       ring=RingInfo(generation=2, members=("w0", "w1"), addresses=("tcp://w0", "tcp://w1"), rank=1))
    as_map = {"shards": [["ps0", "tcp://ps0"]], "worker_index": 1, "num_workers": 3, "batch_size": 32,
              "resume": {"updates": 9.0}, "start_epoch": 0,
              "ring": {"generation": 2, "members": ["w0", "w1"], "addresses": ["tcp://w0", "tcp://w1"], "rank": 1}}
    frames = encode(Welcome(sender="sched", rid=3, heartbeat_interval_s=1.0, info=info))
    assert frames[0] == _with_info(as_map)[0]
    assert decode(frames).info == info


def test_a_restarted_shards_welcome_decodes_to_typed_fields():
    info = decode(_with_info({"shards": [["ps0", "tcp://a"]], "workers": ["cpu0"],
                              "replicas": {"groups": [["ps0", "ps0", "ps1"]], "epoch": 4}})).info
    assert info == WelcomeInfo(shards=(("ps0", "tcp://a"),), workers=("cpu0",),
                               replicas=ReplicaInfo(groups=(("ps0", "ps0", "ps1"),), epoch=4))
    assert info.ring is None and info.batch_size is None


@pytest.mark.parametrize("info, expected", [
    ({"shards": [], "colour": 1}, r"welcome\.info: unexpected keys \['colour'\] for WelcomeInfo"),
    ({"ring": {"generation": 1, "members": [], "addresses": []}},
     r"welcome\.info\['ring'\]: missing keys \['rank'\] for RingInfo"),
    ({"worker_index": "0"}, r"welcome\.info\['worker_index'\]: expected int, got str"),
    ({"shards": [["ps0", 5]]}, r"welcome\.info\['shards'\]\[0\]\[1\]: expected str, got int"),
    ({"replicas": [["ps0", "ps0", ""]]}, r"welcome\.info\['replicas'\]: expected ReplicaInfo, got list"),
])
def test_a_map_that_does_not_fit_is_refused_naming_where(info, expected):
    with pytest.raises(ProtocolError, match=expected) as refused:
        decode(_with_info(info))
    assert refused.value.code == "bad_field"
