"""The fetch round's parts and proposals in compact form (dht.shard_fetch_bodies; docs/scale.md,
Session 27): each travels signed and decodes to what its sender computed, bit for bit (the
part Gram matrices every member sums, the state blocks every member compares); the session 26
JSON forms of a proposal still decode, older parts are refused (session 29: a part in float32,
merge.shard_part); a hostile body is a GroupMessageError with a reason, never a crash;
and the simulator's sizes of both, taken from the real encoders, shrink."""

from __future__ import annotations

import base64
import json
import struct
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping_wire import GroupMessageError
from dht.shard_fetch_wire import (
    FetchMessage,
    decode_fetch,
    part_message,
    part_of,
    proposal_body,
    proposal_of,
    states_body,
    states_of,
)
from merge.identity import Identity
from merge.shard_fetch import Proposal, state_blocks
from merge.shard_part import variants_digest, wire_part
from merge.shard_round import part_gram
from merge.shard_states import states_digest

ME = Identity.generate()
RID = ("groups.0b0", 3, 9)
BASE = (12, "cd" * 32)
finite = st.floats(allow_nan=False, allow_infinity=False)


def _sent(kind: str, body: dict) -> FetchMessage:
    """`body` signed, framed, read back and verified, as a receiver gets it."""
    message = FetchMessage("run", RID, kind, ME.peer_id, body, ()).signed(ME)
    back = decode_fetch(message.to_bytes(), 64)
    assert back.verified()
    return back


def _bits(gram: list[list[float]]) -> list[bytes]:
    return [struct.pack(f"<{len(row)}d", *row) for row in gram]


def _symmetric(upper: list[float], size: int) -> list[list[float]]:
    values = iter(upper)
    gram = [[0.0] * size for _ in range(size)]
    for i in range(size):
        for j in range(i, size):
            gram[i][j] = gram[j][i] = next(values)
    return gram


def _sent_part(part: list[list[float]], variants: list[str]) -> FetchMessage:
    body, tensors = part_message(part, variants)
    message = FetchMessage("run", RID, "part", ME.peer_id, body, tensors).signed(ME)
    back = decode_fetch(message.to_bytes(), 64)  # a model smaller than the triangle
    assert back.verified()
    return back


f32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=80, deadline=None)
@given(size=st.integers(1, 9), data=st.data())
def test_a_part_arrives_bit_for_bit(size: int, data: st.DataObject) -> None:
    upper = data.draw(st.lists(f32, min_size=size * (size + 1) // 2, max_size=55))
    gram = _symmetric(upper, size)  # -0.0, subnormals and 3e38 included
    variants = [f"{k:064x}" for k in range(size)]
    back, theirs = part_of(_sent_part(gram, variants))
    assert theirs == variants_digest(variants)
    assert isinstance(back, list) and _bits(back) == _bits(gram)


def test_a_real_part_arrives_as_its_sender_computed_it() -> None:
    gen = torch.Generator().manual_seed(5)
    gram = wire_part(part_gram([torch.randn(3000, generator=gen) * 10.0**k for k in range(-3, 5)]))
    assert gram is not None
    back, _ = part_of(_sent_part(gram, ["ab" * 32] * 5))
    assert isinstance(back, list) and _bits(back) == _bits(gram)


def _f64(values: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}d", *values)).decode()


DIGEST = base64.b64encode(bytes(32)).decode()
V3 = {"v": 3, "variants": DIGEST}


@pytest.mark.parametrize(
    "body, values, reason",
    [
        (V3, [1.0, 0.0], "wrong_size"),  # 2: no triangle
        (V3, [], "malformed"),  # no triangle at all
        (V3, [1.0] * (69 * 70 // 2), "malformed"),  # longer than any part: not read
        ({"v": 3, "variants": "not base64!"}, [1.0], "malformed"),
        ({"v": 3, "variants": DIGEST + DIGEST}, [1.0], "malformed"),
        ({"v": 3, "variants": "é"}, [1.0], "malformed"),
        ({"v": 3}, [1.0], "malformed"),
        ({"v": 4, "variants": DIGEST}, [1.0], "malformed"),
        ({"variants": DIGEST}, [1.0], "malformed"),
        ({"upper": _f64([1.0]), "digests": DIGEST}, [], "old_version"),  # sessions 27-28
        ({"gram": [[1.0]], "variants": ["0f" * 32]}, [], "old_version"),  # session 26
    ],
)
def test_a_hostile_or_old_part_is_refused_with_a_reason(
    body: dict, values: list[float], reason: str
) -> None:
    tensors = (torch.tensor(values),) if values else ()
    message = FetchMessage("run", RID, "part", ME.peer_id, body, tensors).signed(ME)
    with pytest.raises(GroupMessageError) as caught:
        part_of(decode_fetch(message.to_bytes(), 64))
    assert caught.value.reason == reason


def test_a_part_that_is_not_symmetric_or_not_float32_is_never_sent() -> None:
    with pytest.raises(ValueError):
        part_message([[1.0, 0.5], [0.25, 1.0]], ["00" * 32])
    with pytest.raises(ValueError):
        part_message([[0.0, -0.0], [0.0, 1.0]], ["00" * 32])  # -0.0 and 0.0: other bits
    with pytest.raises(ValueError):
        part_message([[1.0]], ["AB" * 32])  # a digest this node would not compare equal
    with pytest.raises(ValueError):
        part_message([[0.1]], ["00" * 32])  # not a float32 value: wire_part first


holders_st = st.lists(st.sampled_from([f"12D3KooWpeer{i}" for i in range(6)]), min_size=1)
candidates_st = st.dictionaries(
    st.tuples(st.sampled_from(["groups.0b1", "groups.0b10", "groups.0b11"]), st.integers(1, 99)),
    holders_st.map(lambda h: tuple(h[:4])),
    max_size=12,
)


@settings(max_examples=80, deadline=None)
@given(
    candidates=candidates_st,
    width=st.sampled_from([1, 3, 6, 10]),
    num_blocks=st.integers(0, 5),
    data=st.data(),
)
def test_a_proposal_arrives_as_it_was_made(candidates, width, num_blocks, data) -> None:
    states = tuple(
        tuple(data.draw(st.lists(finite, min_size=width, max_size=width)))
        for _ in range(num_blocks)
    )
    proposal = Proposal(BASE, candidates, states)
    back = proposal_of(_sent("propose", proposal_body(proposal)))
    assert back == replace(proposal, states=(), states_sha=states_digest(states))
    blocks = states_of(_sent("states", states_body(states)))  # sent where digests differ
    assert [struct.pack(f"<{width}d", *b) for b in blocks] == [
        struct.pack(f"<{width}d", *b) for b in states
    ]
    assert states_digest(blocks) == back.states_sha


def test_each_holder_is_named_once_and_real_state_blocks_arrive_exactly() -> None:
    gen = torch.Generator().manual_seed(1)
    states = state_blocks([torch.randn(999, generator=gen) for _ in range(3)], 7)
    shared = ("12D3KooWa", "12D3KooWb")
    proposal = Proposal(BASE, {("groups.0b1", 4): shared, ("groups.0b1", 5): shared}, states)
    body = proposal_body(proposal)
    assert body["holders"] == list(shared)
    assert proposal_of(_sent("propose", body)) == replace(
        proposal, states=(), states_sha=states_digest(states)
    )
    assert states_of(_sent("states", states_body(states))) == states


def test_a_session_27_proposal_still_decodes_with_its_blocks() -> None:
    blocks = ((1.5, -0.25, 2.0), (1e-30, -0.0, 3e20))
    old = {
        "base": list(BASE),
        "holders": ["12D3KooWa"],
        "ids": [["groups.0b1", 4, [0]]],
        "states": [2, _f64([x for b in blocks for x in b])],
    }
    back = proposal_of(_sent("propose", old))
    assert back == Proposal(BASE, {("groups.0b1", 4): ("12D3KooWa",)}, blocks)
    assert back.problem() is None and back.states_sha == ""


def test_a_session_26_proposal_still_decodes() -> None:
    old = {
        "base": list(BASE),
        "ids": [["groups.0b1", 4, ["12D3KooWa", "12D3KooWb"]]],
        "states": [[1.5, -0.25, 2.0], [1e-30, 0.0, 3e20]],
    }
    expected = Proposal(
        BASE,
        {("groups.0b1", 4): ("12D3KooWa", "12D3KooWb")},
        ((1.5, -0.25, 2.0), (1e-30, 0.0, 3e20)),
    )
    assert proposal_of(_sent("propose", old)) == expected


GOOD = {"base": list(BASE), "holders": ["h"], "ids": [["groups.0b1", 4, [0]]], "states": [0, ""]}


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"ids": [["groups.0b1", 4, [1]]]}, "malformed"),  # past the table
        ({"ids": [["groups.0b1", 4, [-1]]]}, "malformed"),
        ({"ids": [["groups.0b1", 4, ["h"]]]}, "malformed"),  # a name where an index goes
        ({"ids": [["groups.0b1", 4, [0] * 5]]}, "malformed"),
        ({"ids": [["groups.0b1", 4, []]]}, "malformed"),
        ({"holders": "h"}, "malformed"),
        ({"holders": [""]}, "malformed"),
        ({"holders": ["h"] * 257}, "malformed"),
        ({"states": [[1.0, 0.0, 1.0]]}, "malformed"),  # a session 26 block in the new form
        ({"states": [1, ""]}, "malformed"),
        ({"states": [0, _f64([1.0])]}, "malformed"),
        ({"states": [-1, ""]}, "malformed"),
        ({"states": [2, _f64([1.0, 0.0, 1.0])]}, "wrong_size"),  # 1.5 values a block
        ({"states": [1, _f64([1.0, 0.0])]}, "wrong_size"),  # no triangle of 2
        ({"states": [1, _f64([1.0] * 15)]}, "wrong_size"),  # 5 state tensors: past MAX_STATES
        ({"states": [1, _f64([1.0, float("nan"), 1.0])]}, "not_finite"),
        ({"states": [1, "@@@@"]}, "malformed"),
        ({"states": None}, "malformed"),
        ({"state_sha": DIGEST + DIGEST}, "malformed"),  # session 28: one 32-byte digest
        ({"state_sha": base64.b64encode(bytes(31)).decode()}, "malformed"),
        ({"state_sha": "not base64!"}, "malformed"),
        ({"state_sha": None}, "malformed"),
    ],
)
def test_a_hostile_proposal_is_refused_with_a_reason(change: dict, reason: str) -> None:
    assert proposal_of(_sent("propose", GOOD)) == Proposal(BASE, {("groups.0b1", 4): ("h",)})
    with pytest.raises(GroupMessageError) as caught:
        proposal_of(_sent("propose", {**GOOD, **change}))
    assert caught.value.reason == reason


def test_a_member_names_at_most_two_holders_of_an_id() -> None:
    from dht.group_exchange_fetch import FetchExchange
    from dht.shard_fetch_bodies import NAMED_HOLDERS

    known = {("groups.0b1", 4): ("a", "b", "c", "d"), ("groups.0b1", 3): ("e",)}
    exchange = SimpleNamespace(_candidates=known, _applied=lambda uid: False)
    proposal = FetchExchange._proposal(exchange, BASE, ())  # type: ignore[arg-type]
    assert NAMED_HOLDERS == 2
    assert dict(proposal.candidates) == {("groups.0b1", 3): ("e",), ("groups.0b1", 4): ("a", "b")}


def _session_26_part(num_incoming: int) -> int:
    """A part's bytes as session 26 sent it: the whole Gram matrix in JSON floats."""
    gen = torch.Generator().manual_seed(num_incoming)
    gram = part_gram([torch.randn(512, generator=gen) for _ in range(3 + num_incoming)])
    body = {"gram": gram, "variants": ["0" * 64] * num_incoming}
    return len(FetchMessage("run", RID, "part", ME.peer_id, body, ()).signed(ME).to_bytes())


def test_the_simulators_parts_and_proposals_shrink_and_match_the_wire() -> None:
    from bench import scale_sim_wire as wire

    k, g = 31, 31  # a 1000-node round
    gen = torch.Generator().manual_seed(0)
    gram = wire_part(part_gram([torch.randn(512, generator=gen) for _ in range(3 + k)]))
    assert gram is not None
    body, tensors = part_message(gram, ["0" * 64] * k)
    sim = FetchMessage("scale-sim", wire._RID, "part", wire._SENDER.peer_id, body, tensors)
    size = len(sim.signed(wire._SENDER).to_bytes())  # the sim's framing, a real part
    assert wire.part_bytes(k) == size
    assert wire.part_bytes(k) < 0.15 * _session_26_part(k)
    assert wire.part_bytes(k) < 0.35 * 8018  # sessions 27-28's part at K = 31
    holders = [f"12D3KooW{'x' * 44}{i:04d}" for i in range(4 * k)]  # 52 characters, as real
    old_ids = [[f"group:0b{i:05b}", 10_000 + i, holders[4 * i : 4 * i + 4]] for i in range(k)]
    old = {"base": [10_000, "0" * 64], "ids": old_ids, "states": [[1e3 / 7] * 6] * g}
    session_26 = len(FetchMessage("r", RID, "propose", ME.peer_id, old, ()).signed(ME).to_bytes())
    assert wire.propose_bytes(k, g) < 0.65 * session_26
    assert wire.propose_bytes(k, 125) == wire.propose_bytes(k, g)  # no block per member
    raw = sim.signed(wire._SENDER).to_bytes()
    blob = json.loads(raw[8 : 8 + struct.unpack(">I", raw[4:8])[0]])
    assert set(blob["body"]) == {"v", "variants"} and blob["sizes"] == [34 * 35 // 2]
