"""A member's part in float32 values (merge.shard_part; docs/trust.md, "A member's part in
fp32"; docs/scale.md, Session 29: parts29): the rounding keeps every honest part a Gram matrix
the checks take, every member decides the same plan from parts that crossed the wire, and a
member whose part or sums lie is refused as before, named."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.shard_fetch_wire import FetchMessage, decode_fetch, part_message, part_of
from merge.shard_member import MemberRound
from merge.shard_part import mirrored, triangle_side, upper_triangle, variants_digest, wire_part
from merge.shard_round import gram_problem, part_gram
from tests.unit.shard_round_paths import IDS, NUMEL, _assert_alike, _one_by_one
from tests.unit.test_shard_member import _exchange_sums, _fetch, _rounds, _setup

RID = ("groups.0b0", 3, 9)
BY_PEER = {identity.peer_id: identity for identity in IDS}


def _vectors(seed: int, count: int, length: int) -> list[torch.Tensor]:
    """Random vectors of mixed scales, some parallel, one zero (Cauchy-Schwarz at equality)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        pick = rng.random()
        if out and pick < 0.25:
            out.append(out[rng.randrange(len(out))] * rng.choice([-3.0, 0.5, 1.0]))
        elif pick < 0.3:
            out.append(torch.zeros(length))
        else:
            out.append(torch.randn(length, generator=gen) * 10.0 ** rng.randint(-20, 12))
    return out


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10**6), count=st.integers(1, 12), length=st.integers(1, 300))
def test_a_rounded_honest_part_is_a_gram_matrix_every_check_takes(
    seed: int, count: int, length: int
) -> None:
    exact = part_gram(_vectors(seed, count, length))
    sent = wire_part(exact)
    assert sent is not None
    assert gram_problem(sent, count) is None  # Cauchy-Schwarz, norms >= 0, symmetric
    for i in range(count):
        assert sent[i][i] >= exact[i][i]  # norms up
        for j in range(count):
            assert float(np.float32(sent[i][j])) == sent[i][j]  # float32 values
            assert abs(sent[i][j] - exact[i][j]) <= 2**-23 * abs(exact[i][j]) + 2**-149
            if i != j:
                assert abs(sent[i][j]) <= abs(exact[i][j])  # dot products toward zero
    assert mirrored(upper_triangle(sent), count) == sent
    assert triangle_side(len(upper_triangle(sent))) == count


def test_a_part_beyond_float32_cannot_be_sent() -> None:
    assert wire_part([[1e39]]) is None
    assert wire_part([[float("nan")]]) is None
    assert wire_part([[3.4028235e38]]) is None  # rounds up past the largest float32
    assert wire_part([[1e-46, 0.0], [0.0, 1.0]]) == [[2**-149, 0.0], [0.0, 1.0]]


def test_the_variant_list_digest_names_one_list() -> None:
    a, b = "a" * 64, "b" * 64
    names = {variants_digest(v) for v in ([], [a], [b], [a, b], [b, a], [a, a])}
    assert len(names) == 6


def _wire(member: str, part: object) -> object:
    """`part` as `member` signs and sends it and another member reads it back."""
    assert isinstance(part, list)
    body, tensors = part_message(part, ["0f" * 32])
    message = FetchMessage("run", RID, "part", member, body, tensors)
    back = decode_fetch(message.signed(BY_PEER[member]).to_bytes(), NUMEL)
    assert back.verified()
    gram, digest = part_of(back)
    assert digest == variants_digest(["0f" * 32])
    return gram


def _through_wire(rounds: list[MemberRound], order: list[int]) -> dict[str, object]:
    """Each member's part sent as a `part` message; each member takes the others' in `order`."""
    sent = {m.me: m.part() for m in rounds}
    for index in order:
        member = rounds[index]
        for other in rounds:
            if other.me != member.me:
                member.part_from(other.me, _wire(other.me, sent[other.me]))
    return sent


@settings(max_examples=20, deadline=None)
@given(order=st.permutations([0, 1, 2]), fold=st.booleans())
def test_every_member_decides_one_plan_from_parts_that_crossed_the_wire(
    order: list[int], fold: bool
) -> None:
    members, reference, updates = _setup(fold)
    rounds = _rounds(members, updates)
    _fetch(rounds)
    sent = _through_wire(rounds, order)
    for member in rounds:  # what a member sums of its own part is what the others read
        for other in rounds:
            assert other._parts[member.me] == sent[member.me]
    _exchange_sums(rounds)
    plans = [m.plan for m in rounds]
    assert all(p is not None for p in plans)
    assert all(p == plans[0] for p in plans)  # the same coefficients, bit for bit
    results = [m.apply() for m in rounds]
    assert all(r is not None for r in results) and all(m.failed is None for m in rounds)
    for other in members[1:]:
        assert torch.equal(other.replica.params, members[0].replica.params)
    assert plans[0] is not None
    decided = [d.incoming.update for d in plans[0].decisions]
    expected = _one_by_one(reference, [u for u in decided if u is not None])
    assert [r.accepted for r in results[0] or []] == [r.accepted for r in expected]
    _assert_alike(members[0], reference)


def _scaled(part: list[list[float]], index: int, factor: float) -> list[list[float]]:
    """`part` as if the member's slice of the `index`-th basis vector were `factor` times
    what it is: still a Gram matrix of real vectors, in float32 values."""
    out = [row[:] for row in part]
    for k in range(len(part)):
        out[index][k] *= factor
        out[k][index] *= factor
    out[index][index] = part[index][index] * factor * factor
    return [[float(np.float32(x)) for x in row] for row in out]


@pytest.mark.parametrize(
    ("lie", "problem"),
    [
        ("params", "gram_wrong_state"),  # the params' slice claimed shorter
        ("schwarz", "gram_beyond_schwarz"),  # a dot product its norms do not allow
        ("update", "sums_norm"),  # an update's slice claimed half as long, honest sums
    ],
)
def test_a_member_whose_float32_part_lies_is_refused_and_named(lie: str, problem: str) -> None:
    members, _, updates = _setup(False)
    rounds = _rounds(members, updates)
    _fetch(rounds)
    liar = rounds[0]
    sent = {m.me: m.part() for m in rounds}
    honest = sent[liar.me]
    assert isinstance(honest, list)
    if lie == "params":
        told = _scaled(honest, 0, 0.5)
    elif lie == "schwarz":
        told = [row[:] for row in honest]
        bound = math.sqrt(told[3][3] * told[4][4])
        told[3][4] = told[4][3] = float(np.float32(bound * 1.01))
    else:
        told = _scaled(honest, 3, 0.5)
    for member in rounds[1:]:
        for other in rounds:
            if other.me != member.me:
                part = told if other.me == liar.me else sent[other.me]
                member.part_from(other.me, _wire(other.me, part))
    if problem != "sums_norm":
        for member in rounds[1:]:
            assert member.failed == f"{problem} from {liar.me}"
        return
    for member in rounds[1:]:
        assert member.failed is None
        member.decide()
    liar._parts.update({m.me: sent[m.me] for m in rounds[1:]})
    liar._parts[liar.me] = told  # a liar that decides on its own lie
    liar.decide()
    sums = {m.me: m.sums() for m in rounds}
    for member in rounds[1:]:
        for other in rounds:
            if other.me != member.me and member.failed is None:
                member.sums_from(other.me, sums[other.me] or [])
        assert member.failed == f"{problem} from {liar.me}"
        assert member.apply() is None
