"""A newcomer checks the state a donor served against what the other live peers report.

The donor is chosen by its own claim of progress, so its state is checked before it replaces
the replica, against signed heartbeats of other peers:

- every author's highest applied seq may not exceed what that author's own signed
  heartbeat says it published (+1 for an update in flight): a state claiming updates nobody
  published would make every later honest update look like a replay;
- when other peers report the same applied set (digest), the state's parameters must match
  their replica sketch (drift below `max_drift`): a poisoned model behind an honest
  applied set is refused.

A refusal is counted as `bad_state` against the donor and the next donor is tried.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping

import torch

from dht.heartbeat import Heartbeat
from merge.sketch import relative_distance

MAX_DRIFT = 0.05
"""Replicas with one applied set differ by their momentum tail only: far below this."""


class StateCheckError(ValueError):
    """A donor's state that the other live peers' heartbeats contradict."""


def applied_digest(applied: Mapping[str, list[int]]) -> str:
    """The digest Replica.applied_digest computes, for an applied set not yet loaded."""
    lines = sorted(f"{author}:{seq}\n" for author, seqs in applied.items() for seq in seqs)
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def check_donor_state(
    state: Mapping[str, object],
    donor: str,
    peers: list[Heartbeat],
    sketch: Callable[[torch.Tensor], list[float]],
    *,
    max_drift: float = MAX_DRIFT,
) -> None:
    """StateCheckError when the heartbeats of peers other than `donor` contradict `state`."""
    applied = state.get("applied")
    params = state.get("params")
    if not isinstance(applied, Mapping) or not isinstance(params, torch.Tensor):
        raise StateCheckError("the state lacks its applied set or parameters")
    _check_seqs_published(applied, peers)
    others = [h for h in peers if h.peer_id != donor]
    same = [h for h in others if h.applied_digest == applied_digest(applied) and h.sketch]
    if same:
        ours = sketch(params)
        distances = [relative_distance(ours, h.sketch) for h in same]
        if not any(d is not None and d <= max_drift for d in distances):
            raise StateCheckError(
                "the state's parameters differ from those of peers with the same applied set"
            )


def _check_seqs_published(applied: Mapping[str, object], peers: list[Heartbeat]) -> None:
    published = {h.peer_id: h.latest_seq for h in peers}
    for author, seqs in applied.items():
        if author in published and isinstance(seqs, list) and seqs:
            highest = max(s for s in seqs if isinstance(s, int))
            if highest > published[author] + 1:
                raise StateCheckError(
                    f"the state holds update {highest} of {author}, who published "
                    f"{published[author]}"
                )
