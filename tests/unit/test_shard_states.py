"""A fetch round's state blocks by their digest (merge.shard_states; docs/scale.md, Session 28):
on random rounds (members at one state, members whose blocks differ in one slice only, by
rounding within the slack or past it, -0.0 for 0.0, members at other bases, members with no
blocks) every member composes from the digest proposals and the `states` messages exactly the
round it composes from the full proposals; the members that exchange blocks agree on it from
both sides; blocks that do not hash to the signed digest leave the sender's proposal out of
bounds and are counted."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping_wire import RoundId
from dht.shard_fetch_wire import (
    FetchMessage,
    decode_fetch,
    proposal_body,
    proposal_of,
    states_body,
    states_of,
)
from merge.identity import Identity
from merge.shard_fetch import Proposal, StateBlock, compose, left_out, state_gap
from merge.shard_states import resolved, states_digest, states_wanted

ME = Identity.generate()
RID: RoundId = ("groups.0b0", 2, 5)
UID = ("groups.0b1", 3)
BASES = [(7, "ab" * 32), (8, "cd" * 32)]
values = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False).filter(lambda x: abs(x) > 1e-3)


def _wire(kind: str, body: dict) -> FetchMessage:
    message = FetchMessage("run", RID, kind, ME.peer_id, body, ()).signed(ME)
    back = decode_fetch(message.to_bytes(), 64)
    assert back.verified()
    return back


def _changed(blocks: tuple[StateBlock, ...], how: str, at: int) -> tuple[StateBlock, ...]:
    """`blocks` with the slice `at` changed `how` (the other slices bit for bit alike)."""
    block = list(blocks[at])
    if how == "rounding":
        block[-1] = block[-1] * (1 + 1e-12)  # within STATE_SLACK
    elif how == "apart":
        block[-1] = block[-1] * 1.01 + 1.0
    elif how == "zero_sign":
        block[0] = -0.0 if block[0] == 0.0 else 0.0
    return (*blocks[:at], tuple(block), *blocks[at + 1 :])


@st.composite
def rounds(draw: st.DrawFn) -> tuple[list[str], dict[str, Proposal]]:
    g = draw(st.integers(2, 6))
    width = draw(st.sampled_from([1, 3, 6]))
    start = tuple(tuple(draw(st.lists(values, min_size=width, max_size=width))) for _ in range(g))
    if draw(st.booleans()):  # a zero that another member may hold as -0.0
        start = tuple((0.0, *block[1:]) for block in start)
    members = [f"m{k}" for k in range(g)]
    kinds = st.sampled_from(["same", "same", "rounding", "apart", "zero_sign", "none"])
    full = {}
    for m in members:
        how = draw(kinds)
        states = () if how == "none" else _changed(start, how, draw(st.integers(0, g - 1)))
        base = BASES[draw(st.integers(0, 1))] if draw(st.booleans()) else BASES[0]
        full[m] = Proposal(base, {UID: ("h",)}, states)
    return members, full


def _decided(proposals: dict[str, Proposal], members: list[str], me: str) -> tuple:
    composition = compose(proposals, members)
    out = None if isinstance(composition, str) else left_out(composition, proposals, me)
    return composition, out, state_gap([proposals[m].states for m in sorted(members)])


@settings(max_examples=300, deadline=None)
@given(rounds())
def test_every_member_decides_from_digests_what_it_decides_from_full_blocks(round_) -> None:
    members, full = round_
    on_wire = {m: proposal_of(_wire("propose", proposal_body(p))) for m, p in full.items()}
    blocks = {m: states_of(_wire("states", states_body(p.states))) for m, p in full.items()}
    for me in members:
        heard = {s: p for s, p in on_wire.items() if s != me} | {me: full[me]}
        wanted = states_wanted(heard, me)
        for other in wanted:  # the other member sends this one its blocks too
            theirs = {s: p for s, p in on_wire.items() if s != other} | {other: full[other]}
            assert me in states_wanted(theirs, other)
        got, wrong = resolved(heard, me, {s: blocks[s] for s in wanted})
        assert wrong == [] and got == full
        assert _decided(got, members, me) == _decided(full, members, me)


def test_members_at_one_state_send_no_blocks() -> None:
    states = ((2.0, 0.5, 1.0), (4.0, -1.0, 3.0), (1.0, 0.0, 1.0))
    full = {m: Proposal(BASES[0], {UID: ("h",)}, states) for m in ("a", "b", "c")}
    heard = {"a": full["a"]} | {
        m: proposal_of(_wire("propose", proposal_body(full[m]))) for m in "bc"
    }
    assert states_wanted(heard, "a") == []
    assert resolved(heard, "a", {}) == (full, [])


def test_blocks_not_of_the_signed_digest_are_refused_and_the_round_falls_back() -> None:
    states = ((2.0, 0.5, 1.0), (4.0, -1.0, 3.0))
    other = _changed(states, "apart", 1)
    full = {"a": Proposal(BASES[0], {UID: ("h",)}, states)}
    heard = full | {"b": replace(full["a"], states=(), states_sha=states_digest(other))}
    assert states_wanted(heard, "a") == ["b"]
    got, wrong = resolved(heard, "a", {"b": _changed(other, "rounding", 0)})  # not what it signed
    assert wrong == ["b"] and compose(got, ["a", "b"]) == "proposal_out_of_bounds"
    got, wrong = resolved(heard, "a", {})  # its states message never came
    assert wrong == ["b"] and got["b"].problem() == "states_unresolved"
    got, wrong = resolved(heard, "a", {"b": other})
    assert wrong == [] and compose(got, ["a", "b"]) == "state_differs"
