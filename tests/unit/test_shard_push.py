"""The shard core's push protocol without sockets: each consistency rule as events in (pushes, removals)
and decisions out (reply now, wait for the round or the SSP bound, refuse, what to forward)."""

from __future__ import annotations

import pytest
import torch

from hmp.errors import RequestError
from hmp.messages import Push, Replicate
from hmp.ps.shard_core import AwaitRound, AwaitStaleness, Refuse, Released, ReplyNow, RoundDone, ShardCore

LR = 0.5


def _core(consistency: str = "async", staleness: int = 0, workers=("a", "b"), **kw) -> ShardCore:
    chunks = {0: torch.zeros(4), 1: torch.zeros(6)}  # chunk 1: a table of 3 rows of width 2
    return ShardCore("ps0", chunks, "sgd", {"lr": LR}, consistency, staleness, workers=workers, row_dims={1: 2},
                     **kw)


def _push(worker: str, value: float = 1.0, seq: int = 0, samples: int = 1, **kw) -> Push:
    return Push(sender=worker, keys=(0,), grads=(torch.full((4,), value),), samples=samples, seq=seq, **kw)


def _releases(core: ShardCore) -> list:
    out = []
    while (r := core.next_release()) is not None:
        out.append(r)
    return out


def _param(core: ShardCore, key: int = 0) -> torch.Tensor:
    return core.chunks[key].param.clone()


# ---------------------------------------------------------------- async
def test_an_async_push_is_applied_at_once_and_forwarded_as_applied():
    core = _core()
    push = _push("a", 2.0, seq=3, samples=8)
    decision = core.push(push)
    assert isinstance(decision, ReplyNow) and not decision.duplicate
    assert torch.equal(_param(core), torch.full((4,), -LR * 2.0))
    assert (core.version, core.samples, core.last_seq) == (1, 8, {"a": 3})
    fwd = decision.forward
    assert (fwd.op, fwd.group, fwd.worker, fwd.seq, fwd.samples, fwd.keys) == ("push", "ps0", "a", 3, 8, (0,))
    assert fwd.grads[0] is push.grads[0]  # the received frame itself: no copy
    assert _releases(core) == []


def test_a_retried_push_is_answered_not_applied_twice():
    core = _core()
    core.push(_push("a", seq=5))
    after = _param(core)
    for seq in (5, 4):  # the same push again, or an older one
        assert core.push(_push("a", seq=seq)) == ReplyNow(forward=None, duplicate=True)
    assert torch.equal(_param(core), after) and core.version == 1
    assert isinstance(core.push(_push("b", seq=5)).forward, Replicate)  # another worker's numbers are its own
    assert core.push(_push("a", seq=0)).forward is not None  # seq 0: never deduplicated
    assert core.push(_push("a", seq=0)).forward is not None
    assert core.version == 4


# ---------------------------------------------------------------- sync
def test_a_sync_round_waits_for_every_live_worker_then_applies_the_mean_once():
    core = _core("sync")
    assert core.push(_push("a", 2.0, seq=1)) == AwaitRound(0)
    assert _releases(core) == [] and torch.equal(_param(core), torch.zeros(4))
    assert core.push(_push("b", 4.0, seq=9)) == AwaitRound(0)
    (done,) = _releases(core)
    assert isinstance(done, RoundDone) and (done.round, done.version) == (0, 1)
    assert torch.allclose(_param(core), torch.full((4,), -LR * 3.0))
    assert done.reply_keys == (0,)  # the table was not pushed whole: its rows are wanted, not the chunk
    fwd = done.forward
    assert (fwd.op, fwd.keys, fwd.round_seqs, fwd.samples) == ("round", (0,), {"a": 1, "b": 9}, 2)
    assert torch.allclose(fwd.grads[0], torch.full((4,), 3.0))  # the averaged gradient, as applied
    assert core.last_seq == {"a": 1, "b": 9}
    assert core.push(_push("a", seq=10)) == AwaitRound(1)  # the next round


def test_a_second_push_in_one_round_is_refused():
    core = _core("sync")
    core.push(_push("a"))
    assert core.push(_push("a")) == Refuse("bad_request", "a pushed twice in sync round 0")
    assert core.round_members == {"a"}


def test_a_retry_of_a_contribution_in_the_round_waits_for_it_and_is_not_added_twice():
    core = _core("sync")
    core.push(_push("a", 2.0, seq=7))
    assert core.push(_push("a", 2.0, seq=7)) == AwaitRound(0, duplicate=True)
    core.push(_push("b", 4.0))
    (done,) = _releases(core)
    assert torch.allclose(_param(core), torch.full((4,), -LR * 3.0))  # (2 + 4) / 2: a counted once
    assert core.push(_push("a", 2.0, seq=7)) == ReplyNow(duplicate=True)  # the round applied it


def test_a_sync_push_from_outside_the_group_or_while_stopping_is_refused():
    core = _core("sync")
    assert core.push(_push("z")) == Refuse("bad_request", "z is not in this sync group (['a', 'b'])")
    assert core.push(_push("a"), stopping=True) == Refuse(
        "shutting_down", "shard ps0 is stopping; sync round 0 will not complete")
    assert core.round_members == set()
    core.push(_push("a", seq=4))
    core.push(_push("b"))
    _releases(core)
    assert core.push(_push("a", seq=4), stopping=True) == ReplyNow(duplicate=True)  # applied: still answered


def test_removing_the_last_missing_member_releases_the_round():
    core = _core("sync")
    core.push(_push("a", 2.0))
    core.remove_worker("b")
    (done,) = _releases(core)
    assert isinstance(done, RoundDone) and done.round == 0
    assert torch.allclose(_param(core), torch.full((4,), -LR * 2.0))  # a's alone, not halved


def test_a_removed_worker_that_pushes_again_is_counted_again():
    core = _core("sync")
    core.remove_worker("b")
    assert core.live_workers == {"a"} and core.departed == {"b"}
    assert core.push(_push("b")) == AwaitRound(0)
    assert core.live_workers == {"a", "b"} and core.departed == set()
    assert _releases(core) == []  # a is waited for again too
    core.remove_worker("nobody")  # never counted: not departed either
    assert core.push(_push("nobody")) == Refuse("bad_request", "nobody is not in this sync group (['a', 'b'])")


# ---------------------------------------------------------------- ssp
def test_ssp_holds_a_worker_more_than_staleness_ahead_until_the_slowest_pushes():
    core = _core("ssp", staleness=1)
    assert core.push(_push("a")).forward is not None
    assert core.push(_push("a")).forward is not None  # 1 ahead: within the bound
    waiting = core.push(_push("a", 5.0, seq=3))
    assert isinstance(waiting, AwaitStaleness) and not waiting.duplicate
    assert core.version == 2 and _releases(core) == []
    b = core.push(_push("b", 1.0))
    assert isinstance(b, ReplyNow) and core.version == 3  # b's update first: its forward goes first
    (released,) = _releases(core)
    assert isinstance(released, Released) and released.ticket == waiting.ticket
    assert (released.forward.worker, released.forward.seq) == ("a", 3) and core.version == 4
    assert torch.allclose(_param(core), torch.full((4,), -LR * 8.0))
    assert core.last_seq == {"a": 3} and core.waiting == {}


def test_a_retry_of_a_push_waiting_for_the_bound_waits_with_it_and_is_applied_once():
    core = _core("ssp", staleness=0)
    core.push(_push("a"))
    waiting = core.push(_push("a", seq=2))
    assert core.push(_push("a", seq=2)) == AwaitStaleness(waiting.ticket, duplicate=True)
    core.push(_push("b"))
    assert [r.ticket for r in _releases(core)] == [waiting.ticket]
    assert core.version == 3


def test_a_withdrawn_push_is_never_applied_and_its_retry_is_decided_anew():
    core = _core("ssp", staleness=0)
    core.push(_push("a"))
    first = core.push(_push("a", seq=2))
    core.withdraw(first.ticket)
    retry = core.push(_push("a", seq=2))
    assert isinstance(retry, AwaitStaleness) and not retry.duplicate and retry.ticket != first.ticket
    core.push(_push("b"))
    assert [r.ticket for r in _releases(core)] == [retry.ticket] and core.version == 3


def test_removing_the_slowest_worker_releases_the_pushes_waiting_for_it():
    core = _core("ssp", staleness=0, workers=("a", "b", "c"))
    core.push(_push("a"))
    core.push(_push("b"))
    waiting = [core.push(_push(w)) for w in ("a", "b")]
    assert all(isinstance(d, AwaitStaleness) for d in waiting)
    core.remove_worker("c")
    assert [r.ticket for r in _releases(core)] == [d.ticket for d in waiting]  # in arrival order
    assert core.version == 4


def test_a_push_over_the_bound_is_refused_while_stopping_and_one_within_it_applied():
    core = _core("ssp", staleness=0, node="ps1")  # a group served by another shard than its first
    core.push(_push("a"))
    assert core.push(_push("a"), stopping=True) == Refuse(
        "shutting_down", "shard ps1 is stopping; a's push waited for the SSP bound and was not applied")
    assert core.waiting == {} and isinstance(core.push(_push("b"), stopping=True), ReplyNow)


def test_a_lone_worker_or_async_is_never_held_back():
    for core in (_core("ssp", staleness=0, workers=("a",)), _core("async", workers=("a", "b"))):
        assert all(isinstance(core.push(_push("a")), ReplyNow) for _ in range(5))


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize(("push", "code"), [
    (Push(sender="a", keys=(7,), grads=(torch.zeros(4),)), "unknown_key"),
    (Push(sender="a", keys=(0,), grads=(torch.zeros(5),)), "bad_shape"),
    (Push(sender="a", keys=(0,), grads=(torch.full((4,), float("nan")),)), "non_finite"),
    (Push(sender="a", keys=(), grads=(), row_keys=(1,), rows=(torch.tensor([2, 0]),),
          row_grads=(torch.zeros(2, 2),)), "bad_request"),
    (Push(sender="a", keys=(), grads=(), want_keys=(1,), want_rows=(torch.tensor([3]),)), "bad_request"),
])
def test_a_malformed_push_raises_its_code_and_changes_nothing(push, code):
    for consistency in ("async", "sync"):
        core = _core(consistency)
        with pytest.raises(RequestError) as info:
            core.push(push)
        assert info.value.code == code
        assert core.version == 0 and core.round_members == set() and torch.equal(_param(core), torch.zeros(4))


def test_non_finite_gradients_are_applied_when_not_refused():
    core = _core(reject_nonfinite=False)
    assert isinstance(core.push(_push("a", float("nan"))), ReplyNow) and core.version == 1


# ---------------------------------------------------------------- row-sparse
def _rows(worker: str, rows: list[int], values: list[float], **kw) -> Push:
    g = torch.tensor([[v, v] for v in values])
    return Push(sender=worker, keys=(), grads=(), row_keys=(1,), rows=(torch.tensor(rows),), row_grads=(g,), **kw)


def test_an_async_row_push_changes_only_its_rows_and_forwards_them():
    core = _core()
    decision = core.push(_rows("a", [0, 2], [1.0, 2.0]))
    table = core.chunks[1].param.view(3, 2)
    assert torch.equal(table, torch.tensor([[-0.5, -0.5], [0.0, 0.0], [-1.0, -1.0]]))
    assert decision.forward.row_keys == (1,) and torch.equal(decision.forward.rows[0], torch.tensor([0, 2]))
    assert torch.equal(_param(core), torch.zeros(4))  # the dense chunk: not pushed, not changed


def test_a_sync_round_averages_the_union_of_rows_over_its_members_and_gathers_the_wanted_rows():
    core = _core("sync")
    core.push(_rows("a", [0], [2.0], want_keys=(1,), want_rows=(torch.tensor([0, 2]),)))
    core.push(_rows("b", [0, 1], [4.0, 6.0]))
    (done,) = _releases(core)
    table = core.chunks[1].param.view(3, 2)
    assert torch.allclose(table, torch.tensor([[-1.5, -1.5], [-1.5, -1.5], [0.0, 0.0]]))  # (2+4)/2, (0+6)/2
    assert set(done.wanted) == {"a"} and done.wanted["a"][0] == (1,)
    assert torch.equal(done.wanted["a"][1][0], table[[0, 2]])  # gathered after the round
    assert torch.equal(done.forward.rows[0], torch.tensor([0, 1]))
    assert torch.allclose(done.forward.row_grads[0], torch.full((2, 2), 3.0))


# ---------------------------------------------------------------- replication
@pytest.mark.parametrize("consistency", ["async", "ssp", "sync"])
def test_a_backup_fed_the_decisions_forwards_is_identical_and_duplicates_are_not_forwarded(consistency):
    primary, backup = _core(consistency, staleness=1), _core(consistency, staleness=1)
    forwarded = 0

    def forward(f: Replicate) -> None:  # at once: a round's gradients are its buffers until the next round
        nonlocal forwarded
        forwarded += 1
        if f.op == "push":
            backup.apply(f.worker, f.keys, f.grads, f.samples, f.seq, f.sparse_grads)
        else:
            backup.apply_round(f.keys, f.grads, f.samples, f.round_seqs, f.sparse_grads)

    gen = torch.Generator().manual_seed(0)
    for i in range(12):
        worker = "a" if i % 3 else "b"  # a runs ahead of b
        push = _push(worker, float(torch.randn(1, generator=gen)), seq=i + 1)
        for p in (push, push):  # each push twice: the retry must not be forwarded again
            decision = primary.push(p)
            if isinstance(decision, ReplyNow) and decision.forward is not None:
                forward(decision.forward)
            for r in _releases(primary):
                forward(r.forward)
        if consistency == "sync" and primary.round_members == {"a"}:
            primary.remove_worker("b")
            for r in _releases(primary):
                forward(r.forward)
            primary.add_worker("b")
    assert forwarded > 3 and primary.version == forwarded
    for k, c in primary.chunks.items():
        assert torch.equal(c.param, backup.chunks[k].param), k
    assert (backup.version, backup.last_seq) == (primary.version, primary.last_seq)


def test_a_backup_applies_its_primarys_forwards_in_order_and_once():
    primary, backup = _core(), _core()
    forwards = [primary.push(_push("a", float(i), seq=i + 1)).forward.replace(fseq=i + 1) for i in range(3)]
    assert backup.replicate(forwards[0]) == ""
    assert backup.replicate(forwards[0]) == "forward 1 of ps0 was applied already" and backup.version == 1
    with pytest.raises(RequestError) as info:
        backup.replicate(forwards[2])
    assert info.value.code == "out_of_order" and "forward 3 out of order (last applied 1)" in str(info.value)
    for f in forwards[1:]:
        assert backup.replicate(f) == ""
    assert torch.equal(_param(backup), _param(primary)) and backup.last_seq == primary.last_seq == {"a": 3}


def test_a_new_backup_takes_a_whole_copy_before_any_forward():
    primary, fresh = _core("ssp", staleness=5), _core("ssp", staleness=5)
    fresh.applied_forward = -1  # a placeholder at the initial values
    for i in range(2):
        primary.push(_push("a", 1.0 + i, seq=i + 1))
    primary.remove_worker("b")
    copy = Replicate(group="ps0", fseq=4, op="state", grads=(primary.replica_bytes(),))
    forward = primary.push(_push("a", 3.0, seq=3)).forward.replace(fseq=5)
    with pytest.raises(RequestError, match="a copy is expected first"):
        fresh.replicate(forward)
    assert fresh.replicate(copy) == "copy of ps0 at version 2"
    assert fresh.replicate(forward) == ""
    assert torch.equal(_param(fresh), _param(primary)) and fresh.version == 3
    assert fresh.live_workers == {"a"} and fresh.departed == {"b"}  # counts the same workers
    with pytest.raises(RequestError) as info:
        fresh.replicate(Replicate(group="ps0", fseq=6, op="bogus"))
    assert info.value.code == "bad_request" and fresh.applied_forward == 5
