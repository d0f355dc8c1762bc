"""A learner group's round from each member's side (dht/grouping_round.py): untrusted
messages are refused with a counted reason and never raise anything else; members dropping
at random points (late for the deadline, killed after it with or without their co-signature
out) leave every live member with the same complete update, or with nothing: never half."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping_round import Cosign, GroupRound, decode_cosign
from dht.grouping_wire import (
    GroupMessageError,
    decode_part,
    decode_update,
    encode_part,
    encode_update,
    part_max_bytes,
    update_max_bytes,
)
from merge.group_update import (
    Abandoned,
    ContributionHeader,
    GroupUpdate,
    Phase,
    ReductionConfig,
    RoundFields,
)
from merge.identity import Identity

RUN = "run-groups"
KEY = "groups.0b1"
NUMEL = 7
POOL = sorted((Identity.generate() for _ in range(6)), key=lambda i: i.peer_id)
FIELDS = RoundFields(
    run_id=RUN, group_key=KEY, epoch=0, round=4, learners=2, base_applied=3, published_applied=3
)
NO_CLIP = ReductionConfig(max_norm_to_median=0.0)


def _contribution(identity: Identity, seed: int) -> tuple[ContributionHeader, torch.Tensor]:
    tensor = torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))
    return ContributionHeader.of(tensor, identity, FIELDS, tokens=100 + seed), tensor


def test_a_part_round_trips_and_checks_its_author() -> None:
    header, tensor = _contribution(POOL[0], 1)
    blob = encode_part(header, tensor)
    assert len(blob) <= part_max_bytes(NUMEL)
    parsed, received = decode_part(blob, NUMEL)
    assert parsed == header and torch.equal(received, tensor)
    with pytest.raises(GroupMessageError) as caught:
        decode_part(blob, NUMEL + 1)
    assert caught.value.reason == "wrong_size"
    forged = ContributionHeader(**{**header.__dict__, "tokens": 10**6})
    with pytest.raises(GroupMessageError) as caught:
        decode_part(encode_part(forged, tensor), NUMEL)
    assert caught.value.reason == "bad_signature"
    nan = tensor.clone()
    nan[0] = float("nan")
    with pytest.raises(GroupMessageError) as caught:
        decode_part(encode_part(header, nan), NUMEL)
    assert caught.value.reason == "not_finite"


@settings(max_examples=150, deadline=None)
@given(position=st.integers(0, 10_000), value=st.integers(0, 255), junk=st.binary(max_size=64))
def test_a_tampered_or_junk_part_is_a_counted_refusal(
    position: int, value: int, junk: bytes
) -> None:
    header, tensor = _contribution(POOL[1], 2)
    blob = bytearray(encode_part(header, tensor))
    position %= len(blob)
    if blob[position] == value:
        return
    blob[position] = value
    try:  # hex digits in another case spell the same bytes: only the very same part passes
        same = decode_part(bytes(blob), NUMEL)
        assert same[0] == header and torch.equal(same[1], tensor)
    except GroupMessageError:
        pass
    for candidate in (junk, b"DGP1" + junk, encode_part(header, tensor)[:position]):
        with pytest.raises(GroupMessageError):
            decode_part(candidate, NUMEL)


@pytest.mark.parametrize(
    "blob",
    [
        b"DGC2" + b"[" * 100_000,
        b"DGC2{}",
        b"DGC2[]",
        b"DGC2" + b'{"group_key": 1, "epoch": 0, "round": 0, "included": ["a"], "signature": ""}',
        b"DGC2" + b'{"group_key": "k", "epoch": true, "round": 0, "included": ["a"],'
        b' "signature": "' + b"00" * 64 + b'"}',
        b"DGC2" + b'{"group_key": "k", "epoch": 0, "round": 0, "included": [],'
        b' "signature": "' + b"00" * 64 + b'"}',
        b"DGC2" + b'{"group_key": "k", "epoch": 0, "round": 0, "included": "ab",'
        b' "signature": "' + b"00" * 64 + b'"}',
        b"\xff" * 10,
        None,
    ],
)
def test_a_malformed_cosign_is_a_counted_refusal(blob: object) -> None:
    with pytest.raises(GroupMessageError) as caught:
        decode_cosign(blob)
    assert caught.value.reason == "malformed"


def test_a_session_26_cosign_is_refused_as_old_version() -> None:
    """DGC1 co-signed a shard cut by tensor_split with a digest of its values (session 27:
    the chunk grid and chunk roots): refused with that reason, not a signature that fails."""
    current = Cosign(KEY, 0, 4, (POOL[0].peer_id,), b"\x01" * 64).to_bytes()
    assert current[:4] == b"DGC2" and decode_cosign(current).round == 4
    with pytest.raises(GroupMessageError) as caught:
        decode_cosign(b"DGC1" + current[4:])
    assert caught.value.reason == "old_version"


def test_a_cosign_round_trips() -> None:
    cosign = Cosign(KEY, 0, 4, (POOL[0].peer_id, POOL[1].peer_id), b"\x01" * 64)
    assert decode_cosign(cosign.to_bytes()) == cosign


def test_a_group_of_one_completes_at_once() -> None:
    header, tensor = _contribution(POOL[0], 3)
    member = GroupRound(POOL[0], header, tensor, [POOL[0].peer_id], opened_at=0.0, wait_s=10.0,
                        cosign_s=10.0)  # fmt: skip
    assert member.tick(0.0) and member.phase is Phase.COMPLETED
    assert isinstance(member.outcome, GroupUpdate)
    assert torch.equal(member.outcome.aggregate, tensor)


def _completed(n: int) -> GroupUpdate:
    sim = _Sim(n, set(), {}, random.Random(0))
    sim.run()
    outcome = sim.rounds[0].outcome
    assert isinstance(outcome, GroupUpdate)
    return outcome


def test_a_group_update_round_trips_and_a_tampered_one_fails_its_checks() -> None:
    update = _completed(3)
    blob = encode_update(update)
    assert len(blob) <= update_max_bytes(NUMEL)
    back = decode_update(blob, NUMEL)
    assert back == update and torch.equal(back.aggregate, update.aggregate)
    members = {i.peer_id for i in POOL}.__contains__
    assert back.problem(members) is None
    tampered = bytearray(blob)
    tampered[-1] ^= 0x40  # the aggregate's last float
    assert decode_update(bytes(tampered), NUMEL).problem(members) == "shard_mismatch"


@settings(max_examples=100, deadline=None)
@given(position=st.integers(0, 100_000), value=st.integers(0, 255))
def test_a_corrupted_group_update_is_refused_or_fails_its_checks(position: int, value: int) -> None:
    blob = bytearray(encode_update(_UPDATE))
    position %= len(blob)
    if blob[position] == value:
        return
    blob[position] = value
    try:
        update = decode_update(bytes(blob), NUMEL)
    except GroupMessageError:
        return
    if update.problem({i.peer_id for i in POOL}.__contains__) is None:  # the same, spelled
        assert update == _UPDATE and torch.equal(update.aggregate, _UPDATE.aggregate)


class _Sim:
    """Members of one group exchanging parts and co-signatures through a shuffled queue."""

    def __init__(self, n: int, late: set[int], killed: dict[int, bool], rng: random.Random):
        self.ids = POOL[:n]
        self.members = [i.peer_id for i in self.ids]
        self.late, self.killed, self.rng = late, killed, rng
        self.parts = {i: _contribution(self.ids[i], i) for i in range(n)}
        self.rounds: dict[int, GroupRound] = {}
        self.dead: set[int] = set()
        self.queue: list[tuple[int, int, Cosign]] = []

    def open(self, i: int, at: float) -> None:
        header, tensor = self.parts[i]
        self.rounds[i] = GroupRound(self.ids[i], header, tensor, self.members, opened_at=at,
                                    wait_s=10.0, cosign_s=10.0, config=NO_CLIP)  # fmt: skip

    def send(self, sender: int, cosigns: list[Cosign]) -> None:
        for cosign in cosigns:
            for peer in self.rounds[sender].recipients():
                self.queue.append((sender, self.members.index(peer), cosign))

    def drain(self) -> None:
        while True:
            while self.queue:
                sender, to, cosign = self.queue.pop(self.rng.randrange(len(self.queue)))
                if sender in self.dead:
                    continue
                if to in self.dead:  # the stream fails: the sender loses it
                    self.send(sender, self.rounds[sender].on_lost(self.members[to]))
                elif to in self.rounds:
                    self.rounds[to].on_cosign(self.members[sender], cosign)
            changed = False
            for i, member in self.rounds.items():  # membership: a missing cosigner not alive
                if i in self.dead or member.done:
                    continue
                for peer in member.missing_cosigners():
                    if self.members.index(peer) in self.dead:
                        self.send(i, member.on_lost(peer))
                        changed = True
            for i, member in self.rounds.items():  # a completer pushes its update
                if i not in self.dead and isinstance(member.outcome, GroupUpdate):
                    for j, other in self.rounds.items():
                        if j not in self.dead and j != i and not other.done:
                            changed |= other.adopt(member.outcome)
            if not (changed or self.queue):
                return

    def run(self) -> None:
        n = len(self.members)
        on_time = [i for i in range(n) if i not in self.late]
        for i in on_time:
            self.open(i, 0.0)
        deliveries = [(i, j) for i in on_time for j in on_time if i != j]
        self.rng.shuffle(deliveries)
        for i, j in deliveries:
            self.rounds[j].on_part(*self.parts[i])
        for i in on_time:  # the deadline: every on-time member closes and co-signs
            cosigns = self.rounds[i].tick(10.0)
            if i in self.killed:
                if self.killed[i]:  # its co-signature out, then killed
                    self.send(i, cosigns)
                    self.drain_only_from(i)
                self.dead.add(i)
            else:
                self.send(i, cosigns)
        self.drain()
        for i in sorted(self.late):  # late: opens after the others' deadline
            self.open(i, 11.0)
            for j in on_time:
                self.rounds[i].on_part(*self.parts[j])
                if j not in self.dead:
                    assert not self.rounds[j].on_part(*self.parts[i])
            self.send(i, self.rounds[i].tick(21.0))
        self.drain()
        for i, member in self.rounds.items():
            if i not in self.dead:
                self.send(i, member.tick(100.0))
        self.drain()

    def drain_only_from(self, sender: int) -> None:
        mine = [m for m in self.queue if m[0] == sender]
        self.queue = [m for m in self.queue if m[0] != sender]
        for _, to, cosign in mine:
            if to not in self.killed:
                self.rounds[to].on_cosign(self.members[sender], cosign)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 6),
    late=st.sets(st.integers(0, 5), max_size=3),
    killed=st.dictionaries(st.integers(0, 5), st.booleans(), max_size=3),
    seed=st.integers(0, 2**32 - 1),
)
def test_members_dropping_at_random_points_complete_alike_or_abandon(
    n: int, late: set[int], killed: dict[int, bool], seed: int
) -> None:
    late = {i for i in late if 0 < i < n}  # member 0 is on time and lives
    killed = {i: sent for i, sent in killed.items() if 0 < i < n and i not in late}
    sim = _Sim(n, late, killed, random.Random(seed))
    sim.run()
    live = [m for i, m in sim.rounds.items() if i not in sim.dead]
    assert all(m.outcome is not None for m in live), "a live member still waiting"
    updates = [m.outcome for m in live if isinstance(m.outcome, GroupUpdate)]
    on_time = {sim.members[i] for i in range(n) if i not in late}
    survivors = on_time - {sim.members[i] for i in killed}
    for update in updates:
        assert update == updates[0], "two members hold different updates"
        assert torch.equal(update.aggregate, updates[0].aggregate)
        assert update.problem(set(sim.members).__contains__) is None
        included = {h.author for h in update.contributions}
        assert survivors <= included <= on_time
        expected = torch.stack([sim.parts[sim.members.index(a)][1] for a in sorted(included)])
        assert torch.allclose(update.aggregate, expected.mean(0), atol=1e-6)
    quorum = max(1, -(-n // 2))
    if not killed and len(on_time) >= quorum:
        assert len(updates) == len(live), "nobody dropped out, yet a member has no update"
    lost_one = list(killed.values()) == [False]
    if lost_one and len(survivors) >= quorum:
        assert len(updates) == len(live), "one member lost: the retry without it completes"
    for m in live:
        if isinstance(m.outcome, Abandoned):
            assert m.outcome.reason in {"below_quorum", "reducer_lost", "cosign_timeout"}


_UPDATE = _completed(3)
