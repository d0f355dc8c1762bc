"""The applied digest is cached by applied-set version: always equal to a fresh computation."""

from __future__ import annotations

import hashlib

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.replica import Replica
from tests.unit.test_merge_replica import header, make_replica


def _fresh_digest(replica: Replica) -> str:
    lines = sorted(f"{a}:{s}\n" for a, seqs in replica.applied.items() for s in seqs)
    return hashlib.sha256("".join(lines).encode()).hexdigest()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("apply"), st.sampled_from("abc"), st.integers(1, 30)),
            st.tuples(st.just("digest"), st.none(), st.none()),
            st.tuples(st.just("load"), st.none(), st.none()),
        ),
        max_size=40,
    )
)
def test_the_cached_digest_follows_every_change_of_the_applied_set(
    steps: list[tuple[str, str | None, int | None]],
) -> None:
    replica, donor = make_replica(), make_replica()
    donor.apply(header("d", 1), torch.zeros(4), 0.0)
    for action, author, seq in steps:
        if action == "apply" and author is not None and seq is not None:
            if not replica.has_applied(author, seq):
                replica.apply(header(author, seq), torch.zeros(4), 0.0)
        elif action == "load":  # a downloaded state replaces the applied set wholesale
            replica.load_state_dict(donor.state_dict())
        assert replica.applied_digest() == _fresh_digest(replica)
