"""The checks every group stream shares (dht/group_exchange_shards.py): a part or piece is
taken only from its own author and run, and a refused message is counted under the reason
its round just counted."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dht.group_exchange_shards import new_refusal, own_message
from dht.grouping_wire import GroupMessageError
from merge.group_update import ContributionHeader, RoundFields
from merge.identity import Identity

RUN = "run-groups"
AUTHOR, OTHER = Identity.generate(), Identity.generate()
FIELDS = RoundFields(
    run_id=RUN,
    group_key="groups.0b1",
    epoch=0,
    round=4,
    learners=2,
    base_applied=3,
    published_applied=3,
)
HEADER = ContributionHeader.of(torch.ones(5), AUTHOR, FIELDS, tokens=100)


def test_a_part_from_its_author_and_run_passes() -> None:
    own_message(HEADER, AUTHOR.peer_id, RUN, "a part")


@pytest.mark.parametrize(
    ("sender", "run_id", "reason"),
    [(OTHER.peer_id, RUN, "wrong_sender"), (AUTHOR.peer_id, "another-run", "wrong_run")],
    ids=["wrong_sender", "wrong_run"],  # not the generated peer ids: the same on every collection
)
def test_a_relayed_or_foreign_part_is_refused_with_its_reason(
    sender: str, run_id: str, reason: str
) -> None:
    with pytest.raises(GroupMessageError) as caught:
        own_message(HEADER, sender, run_id, "a piece")
    assert caught.value.reason == reason and "a piece" in str(caught.value)


counts = st.dictionaries(st.sampled_from(["late", "duplicate", "wrong_round"]), st.integers(0, 9))


@given(before=counts, reason=st.sampled_from(["late", "duplicate", "headers_disagree"]))
def test_the_refusal_named_is_the_one_just_counted(before: dict[str, int], reason: str) -> None:
    after = {**before, reason: before.get(reason, 0) + 1}
    assert new_refusal(before, after) == reason


@given(before=counts)
def test_nothing_counted_is_a_plain_refusal(before: dict[str, int]) -> None:
    assert new_refusal(before, dict(before)) == "refused"
