"""Learner groups' updates in the gossip (dht/gossip_groups.py): a fetched group update is
taken only as the id asked for; a peer's summary naming a group key's seqs is let through up
to the highest group seq known here; CatchUp wants a group update from the peers that hold it
and declares it lost when none is alive."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.catchup import CatchUp, CatchUpConfig, Fetch
from dht.gossip_groups import group_ceilings, group_update_id, is_group_key, parse_fetched
from dht.grouping import group_key
from dht.grouping_wire import encode_update
from dht.summary_bounds import SummaryLimits, reduce_summary
from dht.transport import encode_request
from merge.group_update import ContributionHeader, GroupReduction, GroupUpdate, RoundFields
from merge.identity import Identity

NUMEL = 8
MEMBERS = [Identity.generate() for _ in range(2)]


def _update(key: str = group_key("0"), round_: int = 4) -> GroupUpdate:
    fields = RoundFields(
        run_id="r", group_key=key, epoch=1, round=round_, learners=2, base_applied=3,
        published_applied=4,
    )  # fmt: skip
    red = GroupReduction(group_key=key, epoch=1, round=round_, members=[m.peer_id for m in MEMBERS])
    for i, m in enumerate(MEMBERS):
        tensor = torch.full((NUMEL,), float(i + 1))
        assert red.contribute(ContributionHeader.of(tensor, m, fields, 10), tensor)
    red.close()
    for m in MEMBERS:
        red.cosign(m.peer_id, m.sign(red.statement(m.peer_id)))
    assert isinstance(red.outcome, GroupUpdate)
    return red.outcome


def test_group_keys_are_told_from_peer_ids() -> None:
    assert is_group_key("groups.0b") and is_group_key("groups.0b0110")
    assert not is_group_key(MEMBERS[0].peer_id) and not is_group_key("groups.0b012")
    assert group_update_id(_update()) == ("groups.0b0", 5)  # seq: the round + 1


def test_a_fetched_group_update_is_taken_only_as_the_id_asked_for() -> None:
    update = _update()
    blob = encode_update(update)
    parsed = parse_fetched(blob, ("groups.0b0", 5), NUMEL)
    assert isinstance(parsed, GroupUpdate) and torch.equal(parsed.aggregate, update.aggregate)
    assert parse_fetched(blob, ("groups.0b0", 6), NUMEL) == "malformed"  # another round's
    assert parse_fetched(blob, ("groups.0b1", 5), NUMEL) == "malformed"  # another group's
    assert parse_fetched(b"junk" + blob, ("groups.0b0", 5), NUMEL) == "group_update_malformed"
    cut_short = parse_fetched(blob[:-4], ("groups.0b0", 5), NUMEL)
    assert isinstance(cut_short, str) and cut_short.startswith("group_update_")


def test_a_summary_may_name_a_new_group_keys_seqs_up_to_the_groups_known_round() -> None:
    """After a regrouping (groups.0b -> groups.0b0, groups.0b1) at round 200, an honest peer's
    summary names groups.0b1's seqs from 201 on: past the slack of an author with no
    evidence, within that of the highest group seq known here."""
    own = {"groups.0b": [(1, 200)]}
    named = {"groups.0b1": [[201, 203]], "groups.0b0": [[100_000, 100_000]]}
    blob = encode_request(applied=named, retained={})
    limits = SummaryLimits()
    plain = reduce_summary(blob, own, {}, limits)
    assert plain.applied == {} and plain.num_beyond == 4
    known = {"groups.0b": 200, "peer": 9_999}  # a peer's seqs bound no group key
    ceilings = group_ceilings(known, named)
    assert ceilings == {"groups.0b1": 200, "groups.0b0": 200}
    bounded = reduce_summary(blob, own, ceilings, limits)
    assert bounded.applied == {"groups.0b1": [(201, 203)]} and bounded.num_beyond == 1
    assert group_ceilings(known, ["peer"]) == {}
    # As the repair reduces it: the rule given the ceilings and the applied set it raises.
    derived = reduce_summary(blob, own, {"peer": 9_999}, limits, derive=group_ceilings)
    assert derived == bounded


def test_a_group_update_is_fetched_from_its_holders_and_lost_when_none_is_alive() -> None:
    applied: set[tuple[str, int]] = set()

    class Applied:
        def has_applied(self, author: str, seq: int) -> bool:
            return (author, seq) in applied

    catchup = CatchUp(CatchUpConfig(lost_after_s=10.0, retry_s=1.0), "me", Applied())
    key = "groups.0b1"
    ranges = {key: [(7, 8)]}
    learned = catchup.summary("holder", ranges, ranges, now=0.0)
    assert learned.num_new == 2
    fetches = catchup.next_fetches(1.0, alive={"holder"})
    assert [f.update_id for f in fetches] == [(key, 7), (key, 8)]
    assert all(f.peer_id == "holder" for f in fetches)  # never the group key itself
    applied.add((key, 7))
    catchup.fetched((key, 7))
    catchup.failed((key, 8), "holder", 2.0)
    catchup.held(key, "other", [(8, 8)], 3.0)  # another holder's record
    assert catchup.next_fetches(4.0, alive={"holder", "other"}) == [Fetch(key, 8, "other")]
    catchup.failed((key, 8), "other", 5.0)
    assert catchup.declare_lost(6.0, alive=set()) == []
    assert catchup.declare_lost(16.0, alive=set()) == [(key, 8)]
    assert (key, 8) in catchup.lost


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.one_of(
            st.text("01", max_size=5).map(group_key),
            st.sampled_from(["peer-a", "peer-b", "groups.0b2", "groups"]),
        ),
        st.integers(0, 10_000),
        max_size=8,
    ),
    st.lists(st.text("01", max_size=5).map(group_key) | st.just("peer-a"), max_size=6),
)
def test_group_ceilings_bound_group_keys_only_by_the_highest_group_seq_known(
    known: dict[str, int], authors: list[str]
) -> None:
    ceilings = group_ceilings(known, authors)
    top = max((seq for a, seq in known.items() if is_group_key(a)), default=0)
    assert set(ceilings) == {a for a in authors if is_group_key(a)}
    for author, ceiling in ceilings.items():
        assert ceiling == max(top, known.get(author, 0)) == top
