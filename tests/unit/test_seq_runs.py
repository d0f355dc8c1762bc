"""node.network_swarm.seq_runs: an applied set's seqs as runs, and back (bench.chaos reads
them from `state_downloaded` events)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from bench.chaos_accounting import downloaded
from node.network_swarm import seq_runs


def test_seqs_become_inclusive_runs() -> None:
    assert seq_runs([1, 2, 3, 7, 9, 10]) == [[1, 3], [7, 7], [9, 10]]
    assert seq_runs([]) == []


@given(st.sets(st.integers(min_value=0, max_value=500)))
def test_runs_expand_back_to_the_seqs_and_never_touch(seqs: set[int]) -> None:
    runs = seq_runs(sorted(seqs))
    event = {"event": "state_downloaded", "applied_runs": {"A": runs, "me": [[0, 3]]}}
    assert [seq for _, seq in downloaded(event, own="me")] == sorted(seqs)
    assert all(b[0] > a[1] + 1 for a, b in zip(runs, runs[1:], strict=False))
