"""Group bytes (session 11, docs/scale.md): a member's part travels in the swarm's codec and
signs what the others decode; a completed round is announced by a small group-done notice,
and who fetches the update on it is decided by `done_action` (dht/grouping_done.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.gossip_groups import OFFER_SLACK, offer_in_bounds
from dht.grouping_done import DONE_GRACE_S, Done, decode_done, done_action
from dht.grouping_round import GroupRound
from dht.grouping_wire import GroupMessageError, coded, decode_part, encode_part, part_max_bytes
from merge.codecs import CODECS
from merge.group_update import ContributionHeader, GroupUpdate, Phase, RoundFields
from merge.identity import Identity

RUN = "run-groups"
KEY = "groups.0b1"
NUMEL = 64
POOL = sorted((Identity.generate() for _ in range(4)), key=lambda i: i.peer_id)
FIELDS = RoundFields(
    run_id=RUN, group_key=KEY, epoch=0, round=4, learners=2, base_applied=3, published_applied=3
)


def _tensor(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("codec", sorted(set(CODECS) - {"fp32"}))
def test_a_coded_part_carries_what_its_author_signed_and_keeps_the_rest(codec: str) -> None:
    total = _tensor(1)
    sent, payload = coded(total, codec)
    header = ContributionHeader.of(sent, POOL[0], FIELDS, tokens=10)
    blob = encode_part(header, sent, codec, payload)
    assert len(blob) <= part_max_bytes(NUMEL)
    parsed, received = decode_part(blob, NUMEL)
    assert parsed == header and torch.equal(received, sent)
    if codec == "bf16":
        assert len(blob) < len(encode_part(header, sent)) - NUMEL  # about half the fp32 body
        assert 0 < float((total - sent).abs().max()) <= float(total.abs().max()) * 2.0**-8
    # Signed over the decoded tensor: the undecoded total is not what the author signed.
    unsigned = ContributionHeader.of(total, POOL[0], FIELDS, tokens=10)
    if not torch.equal(total, sent):
        with pytest.raises(GroupMessageError) as caught:
            decode_part(encode_part(unsigned, total, codec, payload), NUMEL)
        assert caught.value.reason == "bad_signature"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"", "malformed"),
        (b"\x00", "malformed"),
        (b"\x40bf16", "malformed"),
        (b"\x04bf1", "malformed"),
        (b"\x04zz16" + b"\x00" * 2 * NUMEL, "wrong_size"),
        (b"\x04bf16" + b"\x00" * (2 * NUMEL - 1), "wrong_size"),
        (b"\x04\xff\xfe16" + b"\x00" * 2 * NUMEL, "malformed"),
        (b"\x04bf16" + b"\x80\x7f" * NUMEL, "not_finite"),  # bf16 infinity
    ],
)
def test_a_coded_part_that_does_not_decode_is_a_counted_refusal(body: bytes, reason: str) -> None:
    header = ContributionHeader.of(_tensor(2), POOL[1], FIELDS, tokens=10)
    head = encode_part(header, _tensor(2))
    length = int.from_bytes(head[4:8], "big")
    with pytest.raises(GroupMessageError) as caught:
        decode_part(b"DGP2" + head[4 : 8 + length] + body, NUMEL)
    assert caught.value.reason == reason


@settings(max_examples=150, deadline=None)
@given(position=st.integers(0, 10_000), value=st.integers(0, 255))
def test_a_tampered_coded_part_is_refused_or_is_the_same_part(position: int, value: int) -> None:
    sent, payload = coded(_tensor(3), "bf16")
    header = ContributionHeader.of(sent, POOL[2], FIELDS, tokens=10)
    blob = bytearray(encode_part(header, sent, "bf16", payload))
    position %= len(blob)
    blob[position] = value
    try:  # hex digits in another case spell the same bytes: only the very same part passes
        same = decode_part(bytes(blob), NUMEL)
        assert same[0] == header and torch.equal(same[1], sent)
    except GroupMessageError:
        pass


def test_a_done_notice_round_trips_and_names_the_update_id() -> None:
    done = Done(KEY, 0, 4, (POOL[0].peer_id, POOL[1].peer_id))
    assert decode_done(done.to_bytes()) == done
    assert done.seq == 5 and done.round_id == (KEY, 0, 4)


@settings(max_examples=200, deadline=None)
@given(junk=st.binary(max_size=200), fields=st.dictionaries(st.text(max_size=12), st.integers()))
def test_a_malformed_done_notice_is_a_counted_refusal(junk: bytes, fields: dict) -> None:
    import json

    for blob in (junk, b"DGD1" + junk, b"DGD1" + json.dumps(fields).encode(), None):
        try:
            done = decode_done(blob)
        except GroupMessageError as exc:
            assert exc.reason == "malformed"
        else:  # only a well-formed notice parses
            assert isinstance(done.group_key, str) and done.included


def _round(included: int, *, cosigns: int = 0) -> GroupRound:
    """This member's (POOL[0]) round, closed with `included` members in and `cosigns` of the
    others' co-signatures taken (their parts in; the co-signatures made by their keys)."""
    me, others = POOL[0], POOL[1:included]
    member = GroupRound(me, *_part(me, 0), [i.peer_id for i in POOL], opened_at=0.0,
                        wait_s=10.0, cosign_s=10.0)  # fmt: skip
    for i, identity in enumerate(others):
        member.on_part(*_part(identity, i + 1))
    member.tick(10.0)  # the deadline: this member co-signs
    for identity in others[:cosigns]:
        r = member.reduction
        r.cosign(identity.peer_id, identity.sign(r.statement(identity.peer_id)))
    return member


def _part(identity: Identity, seed: int) -> tuple[ContributionHeader, torch.Tensor]:
    tensor = _tensor(seed)
    return ContributionHeader.of(tensor, identity, FIELDS, tokens=10 + seed), tensor


@settings(max_examples=100, deadline=None)
@given(
    included=st.integers(2, 4),
    cosigns=st.integers(0, 3),
    notice=st.integers(2, 4),
    settled=st.sampled_from([None, True, False]),
    running=st.booleans(),
    now=st.floats(10.0, 30.0),
)
def test_who_fetches_on_a_done_notice(
    included: int, cosigns: int, notice: int, settled: bool | None, running: bool, now: float
) -> None:
    """A member that holds the update never fetches it; one whose round is still reducing
    the same included set waits (at most DONE_GRACE_S, never past its co-sign deadline) and
    then adopts; one reducing another set adopts at once; a node not running the round offers
    it to the gossip unless it settled the round with the update."""
    member = _round(included, cosigns=min(cosigns, included - 1)) if running else None
    done = Done(KEY, 0, 4, tuple(i.peer_id for i in POOL[:notice]))
    action = done_action(member, done, settled, now)
    if member is None:
        assert action == ("ignore" if settled else "offer")
    elif member.done:
        assert member.phase is Phase.COMPLETED and action == "ignore"
    elif member.reduction.included == done.included:
        assert isinstance(action, float)
        assert now <= action <= now + DONE_GRACE_S
        assert action <= max(member.cosign_deadline, now)
        assert done_action(member, done, settled, action, waited=True) == "adopt"
    else:
        assert action == "adopt"


def test_a_member_that_completed_ignores_a_notice_and_one_that_abandoned_offers_it() -> None:
    complete = _round(2, cosigns=1)
    assert isinstance(complete.outcome, GroupUpdate)
    done = Done(KEY, 0, 4, complete.reduction.included)
    assert done_action(complete, done, None, 11.0) == "ignore"
    given_up = _round(3)
    given_up.tick(100.0)  # past the co-sign deadline: abandoned, its contribution carried
    assert given_up.done and done_action(given_up, done, None, 100.0) == "offer"


@settings(max_examples=200, deadline=None)
@given(
    known=st.dictionaries(
        st.sampled_from(["groups.0b0", "groups.0b1", "groups.0b", "peer-a"]),
        st.integers(0, 10_000),
        max_size=4,
    ),
    author=st.sampled_from(["groups.0b0", "groups.0b10", "peer-a", ""]),
    seq=st.integers(-5, 20_000),
)
def test_a_done_notice_becomes_a_want_only_within_the_group_ceilings(
    known: dict[str, int], author: str, seq: int
) -> None:
    """An id a notice names is wanted only for a group key, seq >= 1, and no further than the
    highest group seq known here plus the slack (so a member cannot fill catch-up with
    rounds no one will serve)."""
    top = max([s for a, s in known.items() if a.startswith("groups.")] + [0])
    ceiling = max(known.get(author, 0), top) + OFFER_SLACK
    expected = author.startswith("groups.") and 1 <= seq <= ceiling
    assert offer_in_bounds(known, author, seq) == expected


def _bf16_update(bf16: bool) -> GroupUpdate:
    """A complete round of three members; their parts sent in bf16 (all three, so the
    aggregate is rounded to bf16), or one of them in fp32 (not rounded)."""
    from merge.group_update import GroupReduction

    reduction = GroupReduction(
        group_key=KEY, epoch=0, round=4, members=[i.peer_id for i in POOL[:3]]
    )
    for seed, identity in enumerate(POOL[:3]):
        sent, _ = coded(_tensor(seed), "bf16")
        sent = sent if bf16 or seed else _tensor(seed)  # one member's codec is fp32
        reduction.contribute(ContributionHeader.of(sent, identity, FIELDS, tokens=10), sent)
    reduction.close()
    for identity in POOL[:3]:
        reduction.cosign(identity.peer_id, identity.sign(reduction.statement(identity.peer_id)))
    assert isinstance(reduction.outcome, GroupUpdate)
    return reduction.outcome


def test_a_bf16_groups_update_travels_in_bf16_exactly_and_an_fp32_one_in_fp32() -> None:
    from dht.grouping_wire import decode_update, encode_update

    rounded, exact = _bf16_update(True), _bf16_update(False)
    small, large = encode_update(rounded), encode_update(exact)
    assert small[:4] == b"DGU4" and large[:4] == b"DGU3"  # a mean of 3 is not bf16 in general
    assert len(small) - len(large) == -2 * NUMEL
    for update, blob in ((rounded, small), (exact, large)):
        back = decode_update(blob, NUMEL)
        assert torch.equal(back.aggregate, update.aggregate)
        assert back.problem(lambda _: True) is None
    # rounded to nearest: within bf16's bound of the unrounded mean of the same parts
    parts = [coded(_tensor(seed), "bf16")[0] for seed in range(3)]
    mean = torch.stack(parts).sum(0) / 3
    assert torch.allclose(rounded.aggregate, mean, rtol=2.0**-8, atol=0.0)
    assert not torch.equal(rounded.aggregate, mean)


@settings(max_examples=150, deadline=None)
@given(position=st.integers(0, 100_000), value=st.integers(0, 255))
def test_a_tampered_bf16_group_update_is_refused_or_fails_its_checks(
    position: int, value: int
) -> None:
    from dht.grouping_wire import decode_update, encode_update

    update = _bf16_update(True)
    blob = bytearray(encode_update(update))
    position %= len(blob)
    if blob[position] == value:
        return
    blob[position] = value
    try:
        back = decode_update(bytes(blob), NUMEL)
    except GroupMessageError:
        return
    problem = back.problem(lambda _: True)
    assert problem is not None or torch.equal(back.aggregate, update.aggregate)
