"""Who is in the job and in which state: the scheduler's membership as an explicit state machine.

Every node of the topology but the scheduler is a :class:`Member`, in one :class:`MemberState`.
:data:`TRANSITIONS` lists the moves allowed from each state; :meth:`Membership.transition` refuses
any other with :class:`IllegalTransition` (a :class:`~hmp.errors.RequestError`: when a peer's
message asks for it, the peer gets an error reply naming both states). Moving to the state a
member is already in is not a transition: nothing changes and nothing is returned.

::

    EXPECTED --join (worker, shards not all in)--> JOINING --admitted--> LIVE
    EXPECTED --join (shard, or shards ready)-------------------------> LIVE
    LIVE --silent 2 intervals--> SUSPECT --heard from--> LIVE
    LIVE | SUSPECT | DONE --silent 3 intervals--> LOST
    LIVE --final report--> DONE
    any state --leave--> LEFT
    LOST --heard from (a stalled worker of a PS or pipeline job)--> LIVE
    LIVE | SUSPECT | DONE | LOST | LEFT --join again--> JOINING (worker: a restarted process, or one
                                                     back after it was lost or left) or LIVE (shard:
                                                     a restarted process, ``--resume``)

Pure: no clock of its own (callers pass ``now``), no I/O.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Iterator

from hmp.config import WORKER_ROLES
from hmp.errors import RequestError


class MemberState(enum.StrEnum):
    """Where a member of the topology stands (the values appear in the scheduler's status)."""

    EXPECTED = "expected"  # in the topology, not joined yet
    JOINING = "joining"  # a worker whose join is held until every PS shard has joined
    LIVE = "live"  # joined and heard from within the last SUSPECT_AFTER heartbeat intervals
    SUSPECT = "suspect"  # joined, silent for more than SUSPECT_AFTER intervals
    DONE = "done"  # a worker that sent its final report; it still heartbeats until it leaves
    LOST = "lost"  # silent for more than LOST_AFTER intervals
    LEFT = "left"  # said goodbye (``leave``)


S = MemberState
#: Heartbeat intervals of silence after which a joined member is suspect, and lost. The scheduler checks
#: every TICK intervals, so a dead node is declared lost at most LOST_AFTER + TICK = 2.9 intervals after the
#: last message it sent: within the 3 intervals the docs promise, however its death fell between heartbeats.
SUSPECT_AFTER, LOST_AFTER, TICK = 2, 2.8, 0.1
#: States in which a member counts as available (given work, planned with, a shard serving).
UP = frozenset({S.LIVE, S.SUSPECT})
#: States in which a member is expected to heartbeat (liveness applies; the scheduler's drain waits for them).
CONNECTED = UP | {S.DONE}
#: Not joined (yet): the join deadline applies.
NOT_JOINED = frozenset({S.EXPECTED, S.JOINING})
_REJOIN = {S.JOINING, S.LIVE}  # a join from a member seen before: a restarted process

TRANSITIONS: dict[MemberState, frozenset[MemberState]] = {
    S.EXPECTED: frozenset({S.JOINING, S.LIVE, S.LEFT}),
    S.JOINING: frozenset({S.LIVE, S.LEFT}),
    S.LIVE: frozenset({S.SUSPECT, S.DONE, S.LOST, S.LEFT, S.JOINING}),
    S.SUSPECT: frozenset({S.LIVE, S.LOST, S.LEFT, S.JOINING}),
    S.DONE: frozenset({S.LOST, S.LEFT, S.JOINING}),
    S.LOST: frozenset({S.LIVE, S.LEFT, S.JOINING}),
    S.LEFT: frozenset(_REJOIN),
}


class IllegalTransition(RequestError):
    """A move the state machine does not allow (e.g. a final report from a worker that left)."""

    def __init__(self, member: Member, new: MemberState) -> None:
        allowed = ", ".join(sorted(TRANSITIONS[member.state])) or "nothing"
        super().__init__(f"{member.id} ({member.role}) cannot go from {member.state} to {new}; "
                         f"from {member.state} it may go to: {allowed}", "bad_request")
        self.member_id, self.old, self.new = member.id, member.state, new


@dataclasses.dataclass
class Member:
    """One node of the topology as the scheduler sees it."""

    id: str
    role: str
    address: str = ""
    pid: int = 0
    last_seen: float = 0.0
    state: MemberState = MemberState.EXPECTED
    joins: int = 0  # join requests received; only the newest held one is answered
    step: int = 0  # the step its last heartbeat carried (a PS shard's: its version)

    @property
    def is_worker(self) -> bool:
        return self.role in WORKER_ROLES


@dataclasses.dataclass(frozen=True)
class Change:
    """A member moved from ``old`` to ``new``; ``why`` says what made it."""

    node: str
    role: str
    old: MemberState
    new: MemberState
    why: str = ""


class Membership:
    """Every member by id, in topology order; moves them only along :data:`TRANSITIONS`."""

    def __init__(self, nodes: Iterable[tuple[str, str]]) -> None:
        self.members = {nid: Member(nid, role) for nid, role in nodes}

    def __getitem__(self, node_id: str) -> Member:
        return self.members[node_id]

    def __iter__(self) -> Iterator[Member]:
        return iter(self.members.values())

    def __len__(self) -> int:
        return len(self.members)

    def get(self, node_id: str) -> Member:
        """The member ``node_id``; a sender outside the topology gets ``unknown_node``."""
        m = self.members.get(node_id)
        if m is None:
            raise RequestError(f"{node_id!r} is not a node of this topology ({sorted(self.members)})", "unknown_node")
        return m

    def can_move(self, member: Member, new: MemberState) -> bool:
        return new == member.state or new in TRANSITIONS[member.state]

    def transition(self, member: Member, new: MemberState, why: str = "") -> Change | None:
        """Move ``member`` to ``new``: the :class:`Change`, None if it is in ``new`` already;
        :class:`IllegalTransition` if the table does not allow it (the member stays as it was)."""
        if new == member.state:
            return None
        if new not in TRANSITIONS[member.state]:
            raise IllegalTransition(member, new)
        old, member.state = member.state, new
        return Change(member.id, member.role, old, new, why)

    def ids(self, states: Iterable[MemberState], *, workers: bool | None = None) -> list[str]:
        """Members in ``states`` (topology order); ``workers``: only workers (True) or only non-workers (False)."""
        wanted = set(states)
        return [m.id for m in self if m.state in wanted and (workers is None or m.is_worker == workers)]

    def states(self) -> dict[str, str]:
        return {m.id: m.state.value for m in self}
