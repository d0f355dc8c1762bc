"""Group rounds that complete at 16 nodes (dht/grouping_patience.py, dht/grouping_shards.py;
docs/scale.md "Session 18"): a round keeps collecting a grace past its join window, so a
member's pieces sent within the window reach every member before it closes, and a reducer
missing from one member's flapping live view is lost only past the first co-sign deadline.
A virtual-clock simulation of the exchange (members finishing training at random times,
pieces and shards delayed, views flapping, members dead) checks that every live member's
round ends by one extra deadline, that every completed update is the same one, and that with
no member dead and deliveries within the grace every member that joined completes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dht.grouping_patience import (
    MAX_GRACE_S,
    MIN_GRACE_S,
    CosignClock,
    SendRetry,
    collect_s,
    grace_s,
    joins_in_time,
)
from dht.grouping_shards import (
    Piece,
    ShardedRound,
    decode_piece,
    decode_shard,
    encode_piece,
    shard_codec,
)
from merge.group_shards import sharded_contribution
from merge.group_update import Abandoned, ContributionHeader, GroupUpdate, Phase, RoundFields
from merge.identity import Identity
from tests.factories import bf16_values, sharded_rounds

IDS = sorted((Identity.generate() for _ in range(7)), key=lambda i: i.peer_id)
FIELDS = RoundFields(
    run_id="r", group_key="groups.0b", epoch=0, round=3, learners=2, base_applied=0,
    published_applied=0,
)  # fmt: skip
NUMEL = 31
WAIT_S = COSIGN_S = 10.0
STEP_S = 0.1
RETRY_S = 2.0
"""A failed send's next try (a stream that fails at once, and the pause after it)."""


# ---- the pure rules ----------------------------------------------------------------------


@pytest.mark.parametrize(("wait_s", "grace"), [(1.0, 0.5), (4.0, 1.0), (10.0, 2.5), (30.0, 5.0)])
def test_the_grace_is_a_share_of_the_window_within_bounds(wait_s: float, grace: float) -> None:
    assert grace_s(wait_s) == grace and collect_s(wait_s) == wait_s + grace


@given(wait_s=st.floats(0.1, 1e4))
def test_the_grace_is_at_most_half_the_window(wait_s: float) -> None:
    grace = grace_s(wait_s)
    assert 0 < grace <= wait_s / 2
    assert grace <= MAX_GRACE_S
    assert grace >= min(MIN_GRACE_S, wait_s / 2)


def test_a_member_joins_while_its_window_lasts() -> None:
    assert joins_in_time(100.0, None, 10.0)  # it opens the round
    assert joins_in_time(109.9, 100.0, 10.0)
    assert not joins_in_time(110.0, 100.0, 10.0)  # late: kept for its next round


def test_the_grace_moves_the_close_not_the_cosign_deadline() -> None:
    """The round's bound stays wait + 2 x cosign (network_swarm's call waits that and more)."""
    rounds = sharded_rounds(IDS[:3], FIELDS, NUMEL, wait_s=WAIT_S, cosign_s=COSIGN_S, grace_s=2.5)
    member = rounds[IDS[0].peer_id]
    assert member.deadline == 12.5 and member.cosign_deadline == 20.0
    assert member.clock.extension_s == COSIGN_S


def test_the_view_loses_a_reducer_only_past_the_first_deadline() -> None:
    clock = CosignClock(20.0, extension_s=10.0)
    gone = lambda p: p != "b"  # noqa: E731
    assert clock.losses(19.9, ["a", "b"], gone) == []
    assert clock.losses(20.0, ["a", "b"], gone) == ["b"]
    clock.retried()
    assert clock.deadline == 30.0
    clock.retried()  # one extra window, never two
    assert clock.deadline == 30.0 and clock.losses(25.0, ["b"], gone) == ["b"]


# ---- a member's round with a flapping view ----------------------------------------------


@functools.cache
def _parts(size: int) -> dict[str, tuple[torch.Tensor, ContributionHeader, tuple[str, ...]]]:
    out = {}
    for k, ident in enumerate(IDS[:size]):
        part = bf16_values(k, NUMEL)
        header, digests = sharded_contribution(part, ident, FIELDS, 10, size)
        out[ident.peer_id] = (part, header, digests)
    return out


def test_a_reducer_missing_from_a_flapping_view_before_the_deadline_is_waited_for() -> None:
    """Session 15's node15 (groups.0b10, round 5): its view had node9 gone for 3 s; it retried
    alone without node9 at once (the exchange's loop did, before session 18), and the other
    six waited for its shard over their set until they abandoned."""
    flaps = {0: [round(1.0 + k * STEP_S, 1) for k in range(15)]}
    swarm = _swarm(3, ready=[0.0, 0.0, 0.0], delays=[0.05, 1.0, 0.05], dies={}, flaps=flaps)
    outcomes = [r.outcome for r in swarm.rounds.values()]
    assert all(isinstance(o, GroupUpdate) and len(o.contributions) == 3 for o in outcomes)


def _authors(update: GroupUpdate) -> list[str]:
    return [h.author for h in update.contributions]


# ---- the exchange over a virtual clock ---------------------------------------------------


@dataclass
class Swarm:
    """Members of one round as dht.group_exchange runs them: a member opens when its training ends
    (`ready`), joining while its window lasts (`joins_in_time`, from the first piece held for
    it), and collects a grace longer; messages arrive `delay` seconds after they were sent;
    `dead` members stop sending at `dies` (and are gone from every view 4 s later); `flaps[m]`
    are the times m's view says every other member is gone (for one step); `blocked[m]` is a
    span in which every send from m fails (its streams do not open; it still receives): a failed
    piece or shard is tried again `RETRY_S` later, as the exchange does (`SendRetry`: while the
    round lasts; before session 18, MAX_SEND_TRIES tries). A member that completes tells the
    others (group-done), and one still running adopts the update. `old_rules`: as before session
    18 (no grace: a member closes when its join window ends; a reducer its view says is gone is
    lost at once, by the exchange's loop; a shard's recipient every try failed to reach is
    lost)."""

    size: int
    ready: dict[str, float]
    delay: dict[str, float]
    dies: dict[str, float]
    flaps: dict[str, list[float]]
    rounds: dict[str, ShardedRound] = field(default_factory=dict)
    late: set[str] = field(default_factory=set)
    held: dict[str, list[Piece]] = field(default_factory=dict)
    first_seen: dict[str, float] = field(default_factory=dict)
    ended: dict[str, float] = field(default_factory=dict)
    in_flight: list[tuple[float, str, str, str, bytes]] = field(default_factory=list)
    blocked: dict[str, tuple[float, float]] = field(default_factory=dict)
    tries: list[tuple[float, str, str, str, bytes, int]] = field(default_factory=list)
    old_rules: bool = False

    def alive(self, viewer: str, now: float) -> Callable[[str], bool]:
        flapping = any(abs(now - t) < STEP_S / 2 for t in self.flaps.get(viewer, []))
        return lambda p: not flapping and now < self.dies.get(p, 1e9) + 4.0

    def is_blocked(self, member: str, now: float) -> bool:
        start, end = self.blocked.get(member, (-1.0, -1.0))
        return start <= now < end

    def send(
        self, now: float, sender: str, peer: str, kind: str, blob: bytes, tries: int = 1
    ) -> None:
        if now >= self.dies.get(sender, 1e9):
            return
        if kind == "done" and self.is_blocked(sender, now):
            return  # one try (a notice only saves a fetch)
        if self.is_blocked(sender, now):
            member = self.rounds[sender]
            until = None if self.old_rules else member.cosign_deadline
            if SendRetry(tries - 1).failed(now, until):
                self.tries.append((now + RETRY_S, sender, peer, kind, blob, tries + 1))
            elif self.old_rules and kind == "shard" and peer in member.recipients():
                member.on_lost(peer)  # session 14: every try failed, lost
            return
        self.in_flight.append((now + self.delay[sender], sender, peer, kind, blob))

    def retry_sends(self, now: float) -> None:
        due = [t for t in self.tries if t[0] <= now]
        self.tries = [t for t in self.tries if t[0] > now]
        for _when, sender, peer, kind, blob, tries in due:
            self.send(now, sender, peer, kind, blob, tries)

    def deliver(self, now: float) -> None:
        due = [m for m in self.in_flight if m[0] <= now]
        self.in_flight = [m for m in self.in_flight if m[0] > now]
        for _when, sender, peer, kind, blob in due:
            if now >= self.dies.get(peer, 1e9) or peer in self.late:
                continue
            member = self.rounds.get(peer)
            if kind == "done":
                if member is not None and not member.done:
                    member.adopt(self.rounds[sender].outcome)  # type: ignore[arg-type]
                continue
            if kind == "piece":
                piece = decode_piece(blob, NUMEL)
                if member is not None:
                    member.on_piece(piece)
                elif peer not in self.ended:
                    self.held.setdefault(peer, []).append(piece)
                    self.first_seen.setdefault(peer, now)
            elif member is not None:
                member.on_shard(sender, decode_shard(blob, NUMEL))

    def open(self, now: float, me: Identity) -> None:
        peer = me.peer_id
        if not joins_in_time(now, self.first_seen.get(peer), WAIT_S):
            self.late.add(peer)
            self.ended[peer] = now
            return
        opened_at = min(now, self.first_seen.get(peer, now))
        part, header, digests = _parts(self.size)[peer]
        members = [i.peer_id for i in IDS[: self.size]]
        member = self.rounds[peer] = ShardedRound(
            me, header, digests, part, members, opened_at=opened_at, wait_s=WAIT_S,
            cosign_s=COSIGN_S, grace_s=0.0 if self.old_rules else grace_s(WAIT_S),
        )  # fmt: skip
        for piece in self.held.pop(peer, []):
            member.on_piece(piece)

    def step(self, now: float) -> None:
        self.retry_sends(now)
        self.deliver(now)
        for ident in IDS[: self.size]:
            me = ident.peer_id
            if me in self.ended or now >= self.dies.get(me, 1e9):
                continue
            if me not in self.rounds and now >= self.ready[me]:
                self.open(now, ident)
            member = self.rounds.get(me)
            if member is None or me in self.ended:
                continue
            for shard, peer in member.piece_sends():
                piece = member.pieces[shard]
                blob = encode_piece(member.header, member.digests, shard, piece, "bf16")
                self.send(now, me, peer, "piece", blob)
            alive = self.alive(me, now)
            for out in member.tick(now, alive):
                blob = out.to_bytes(shard_codec(out.tensor))
                for peer in member.recipients():
                    self.send(now, me, peer, "shard", blob)
            if self.old_rules and member.phase is Phase.REDUCING:  # the exchange's loop did
                for peer in member.missing_reducers():
                    if peer != me and not alive(peer):
                        member.on_lost(peer)
            if member.done:
                self.ended[me] = now
                if isinstance(member.outcome, GroupUpdate):
                    for peer in member.others():
                        self.send(now, me, peer, "done", b"")

    def run(self) -> Swarm:
        now = 0.0
        while now <= 60.0 and not self.quiet(now):
            self.step(now)
            now = round(now + STEP_S, 6)
        return self

    def quiet(self, now: float) -> bool:
        """Every member's round ended (or it died) and nothing is in flight."""
        gone = [m for m, t in self.dies.items() if now >= t]
        ids = [i.peer_id for i in IDS[: self.size]]
        settled = all(m in self.ended or m in gone for m in ids)
        return not self.in_flight and not self.tries and settled


def _swarm(size: int, ready: list[float], delays: list[float], dies: dict[int, float],
           flaps: dict[int, list[float]], old_rules: bool = False,
           blocked: dict[int, tuple[float, float]] | None = None) -> Swarm:  # fmt: skip
    ids = [i.peer_id for i in IDS[:size]]
    return Swarm(
        size,
        ready=dict(zip(ids, ready, strict=False)),
        delay=dict(zip(ids, delays, strict=False)),
        dies={ids[k]: t for k, t in dies.items() if k < size},
        flaps={ids[k]: ts for k, ts in flaps.items() if k < size},
        blocked={ids[k]: span for k, span in (blocked or {}).items() if k < size},
        old_rules=old_rules,
    ).run()


def test_a_member_ready_in_the_last_second_is_included_by_every_member() -> None:
    """Session 15's groups.0b10 round 10: node6 opened 9.7 s after the round's first piece;
    its pieces came 0.4 s later, after one member's deadline and before the others'."""
    swarm = _swarm(4, ready=[0.0, 0.5, 1.0, 9.9], delays=[0.4, 0.4, 0.4, 0.4], dies={}, flaps={})
    outcomes = [r.outcome for r in swarm.rounds.values()]
    assert len(outcomes) == 4 and all(isinstance(o, GroupUpdate) for o in outcomes)
    assert all(isinstance(o, GroupUpdate) and len(o.contributions) == 4 for o in outcomes)


def test_a_member_ready_after_its_window_stays_out_and_the_others_complete() -> None:
    swarm = _swarm(4, ready=[0.0, 0.5, 1.0, 10.6], delays=[0.4, 0.4, 0.4, 0.4], dies={}, flaps={})
    last = IDS[3].peer_id
    assert last in swarm.late
    outcomes = [r.outcome for r in swarm.rounds.values()]
    assert len(outcomes) == 3 and all(isinstance(o, GroupUpdate) for o in outcomes)
    assert all(isinstance(o, GroupUpdate) and last not in _authors(o) for o in outcomes)


def test_a_reducer_dead_after_its_pieces_is_retried_without_at_the_cosign_deadline() -> None:
    swarm = _swarm(4, ready=[0.0, 0.2, 0.4, 0.6], delays=[0.3] * 4, dies={2: 0.85}, flaps={})
    gone = IDS[2].peer_id
    live = [r for m, r in swarm.rounds.items() if m != gone]
    assert all(isinstance(r.outcome, GroupUpdate) for r in live)
    assert all(isinstance(r.outcome, GroupUpdate) and gone not in _authors(r.outcome) for r in live)
    assert max(t for m, t in swarm.ended.items() if m != gone) <= WAIT_S + 2 * COSIGN_S + 0.5


NODE15: dict[str, Any] = {
    "size": 7, "ready": [1.8, 0.0, 1.0, 1.3, 1.3, 0.8, 1.6], "delays": [0.3] * 7, "dies": {},
    "flaps": {6: [2.3, 2.4, 2.5]},
}  # fmt: skip
"""Session 15's groups.0b10 round 5 (7 members in within 2.2 s; node15's view flapped)."""
LAST_SECOND: dict[str, Any] = {
    "size": 5, "ready": [0.0, 6.9, 8.1, 8.3, 9.9], "delays": [0.4] * 5, "dies": {}, "flaps": {},
}  # fmt: skip
"""Session 15's groups.0b01 rounds 2 and 7 (a member ready just before the deadline)."""


@pytest.mark.parametrize("case", [NODE15, LAST_SECOND], ids=["flapping_view", "last_second"])
def test_rounds_that_the_rules_before_session_18_split_now_complete(case: dict[str, Any]) -> None:
    before = _swarm(**case, old_rules=True)
    after = _swarm(**case)
    assert not all(isinstance(r.outcome, GroupUpdate) for r in before.rounds.values())
    assert all(isinstance(r.outcome, GroupUpdate) for r in after.rounds.values())
    assert len(after.rounds) == case["size"] and not after.late


STALLED: dict[str, Any] = {
    "size": 7, "ready": [0.0, 1.4, 1.8, 1.9, 2.6, 3.0, 3.2], "delays": [0.3] * 7, "dies": {},
    "flaps": {}, "blocked": {4: (3.4, 14.0), 6: (3.4, 14.0)},
}  # fmt: skip
"""Session 18's first after-run, groups.0b01 round 4 (7 members in within 3.2 s): node6's and
node15's shards reached nobody for 10 s (they received the others'); each missed the other's,
and once its tries were spent each retried without the other at ~+14 s, alone; the other
five, two shards missing, abandoned at +20 s."""


def test_a_member_whose_streams_fail_for_seconds_is_not_lost_by_its_peers() -> None:
    before = _swarm(**STALLED, old_rules=True)
    after = _swarm(**STALLED)
    assert not all(isinstance(r.outcome, GroupUpdate) for r in before.rounds.values())
    outcomes = [r.outcome for r in after.rounds.values()]
    assert all(isinstance(o, GroupUpdate) and len(o.contributions) == 7 for o in outcomes)


times = st.sampled_from([0.0, 0.5, 1.0, 2.0, 4.0, 6.0, 7.0, 8.5, 9.0, 9.8, 10.2, 11.0, 13.0])


@settings(max_examples=40, deadline=None)
@example(size=7, ready=[1.8, 0.0, 1.0, 1.3, 1.3, 0.8, 1.6], delays=[0.3] * 7, dead=[],
         dead_at=0.0, flaps={6: [2.3, 2.4, 2.5]}, blocked={})  # fmt: skip
@example(size=5, ready=[0.0, 6.9, 8.1, 8.3, 9.9], delays=[0.4] * 5, dead=[], dead_at=0.0,
         flaps={}, blocked={})  # fmt: skip
@example(size=7, ready=[0.0, 1.4, 1.8, 1.9, 2.6, 3.0, 3.2], delays=[0.3] * 7, dead=[],
         dead_at=0.0, flaps={}, blocked={4: (3.4, 14.0), 6: (3.4, 14.0)})  # fmt: skip
@given(
    size=st.integers(3, 7),
    ready=st.lists(times, min_size=7, max_size=7),
    delays=st.lists(st.sampled_from([0.05, 0.3, 0.6, 1.0]), min_size=7, max_size=7),
    dead=st.lists(st.integers(1, 6), max_size=2),
    dead_at=st.sampled_from([0.0, 3.0, 10.5, 15.0]),
    flaps=st.dictionaries(
        st.integers(0, 6), st.lists(st.floats(0.0, 40.0).map(lambda t: round(t, 1)), max_size=6)
    ),
    blocked=st.dictionaries(
        st.integers(0, 6),
        st.tuples(st.sampled_from([2.0, 5.0, 12.0]), st.sampled_from([3.0, 8.0, 14.0])).map(
            lambda s: (s[0], s[0] + s[1])
        ),
        max_size=2,
    ),
)
def test_rounds_complete_alike_or_abandon_within_one_extra_deadline(
    size: int,
    ready: list[float],
    delays: list[float],
    dead: list[int],
    dead_at: float,
    flaps: dict[int, list[float]],
    blocked: dict[int, tuple[float, float]],
) -> None:
    swarm = _swarm(size, ready, delays, {k: dead_at for k in dead}, flaps, blocked=blocked)
    ids = [i.peer_id for i in IDS[:size]]
    gone = {ids[k] for k in dead if k < size}
    live = [m for m in ids if m not in gone]
    # Live members only: a member that completed and then died before its shard got out
    # holds the first attempt's update while the others retry without it (as before
    # session 18; docs/scale.md, "Session 18", left).
    updates = [
        r.outcome
        for m, r in swarm.rounds.items()
        if m not in gone and isinstance(r.outcome, GroupUpdate)
    ]
    for m in live:
        assert m in swarm.ended, "every live member's round ends"
        opened = swarm.rounds[m].deadline - WAIT_S - grace_s(WAIT_S) if m in swarm.rounds else 0
        assert swarm.ended[m] <= opened + WAIT_S + 2 * COSIGN_S + 0.5, "one extra deadline"
        if m in swarm.rounds:
            outcome = swarm.rounds[m].outcome
            assert isinstance(outcome, GroupUpdate | Abandoned)
    for update in updates:  # never two different updates for one round
        assert update.problem(lambda p: True) is None, "every shard co-signed"
        assert _authors(update) == _authors(updates[0]), "one included set"
        assert torch.equal(update.aggregate, updates[0].aggregate), "one aggregate"
    joined = [m for m in live if m in swarm.rounds]
    quorum = (size + 1) // 2
    if not gone and not blocked and len(joined) >= quorum:  # deliveries within the grace
        assert all(isinstance(swarm.rounds[m].outcome, GroupUpdate) for m in joined), [
            (swarm.rounds[m].outcome, swarm.rounds[m].phase is Phase.REDUCING) for m in joined
        ]
