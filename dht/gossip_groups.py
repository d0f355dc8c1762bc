"""Learner groups' updates in the gossip: retained, announced by holder records, fetched by
catch-up and repair from any holder, counted lost when no live peer holds them.

A group update (merge.group_update.GroupUpdate) is known to gossip by the id every replica
applies it under: (group key, round + 1), the group key standing as its author
(`groups.0b0110`: never a peer id). What differs from a peer's update:

- **Announced by its holders**, not by an author: no one peer may sign for a group key, so
  nothing goes under `updates/<group key>`. Every node that holds one (a member that
  completed or adopted it, a peer it was pushed to, one that fetched it) retains its wire
  bytes and writes its own subkey of `holders/<group key>`, as for a peer's update.
- **Learned by repair**: a replica that missed a push has another applied set than its
  peers (the applied digest in its heartbeat differs), so it exchanges summaries with them;
  their applied and retained ranges name the group key's seqs it lacks (`group_ceilings`
  lets them through), and CatchUp wants them from whoever named them, then from the holder
  records, and declares them lost when no live peer holds them for `lost_after_s`.
- **Checked as a whole when fetched**: its wire form (dht.grouping_wire) parsed within its
  bound, its id the one asked for (`parse_fetched`), then every member's signature and
  co-signature checked by the merge (`submit_group`), as for a pushed one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from dht.grouping import key_prefix
from dht.grouping_wire import GroupMessageError, decode_update
from merge.group_update import GroupUpdate

UpdateId = tuple[str, int]


def is_group_key(author: str) -> bool:
    """Whether an update id's author is a learner group's key (`groups.0b...`)."""
    return key_prefix(author) is not None


def group_update_id(update: GroupUpdate) -> UpdateId:
    """The id replicas apply a group update under: its group key and its round + 1."""
    return (update.head.group_key, update.seq)


def parse_fetched(data: bytes, uid: UpdateId, numel: int) -> GroupUpdate | str:
    """A fetched group update, or the reason to refuse it (counted against the peer that
    served it): it must parse (GroupMessageError's reason) and be the update asked for."""
    try:
        update = decode_update(data, numel)
    except GroupMessageError as exc:
        return f"group_update_{exc.reason}"
    if group_update_id(update) != uid:
        return "malformed"
    return update


def group_ceilings(known: Mapping[str, int], authors: Iterable[str]) -> dict[str, int]:
    """How far a peer's summary may name each group key's seqs (dht.summary_bounds' ceilings):
    the highest seq this node knows of any group key. Groups count rounds alike (a node
    behind its group joins the group's round), and a group key new after a regrouping starts
    at the round the swarm is at, so one group's known seq bounds another's; an author with no
    evidence of its own would be bounded at 0 plus the slack, which refuses an honest peer's
    summary once the run is past that many rounds. `known`: per author, the highest seq this
    node has evidence of; `authors`: the group keys to bound (those in a summary)."""
    top = max((seq for author, seq in known.items() if is_group_key(author)), default=0)
    return {author: max(known.get(author, 0), top) for author in authors if is_group_key(author)}


OFFER_SLACK = 64
"""How far past the highest group seq known here a group-done notice may name a round."""


def offer_in_bounds(known: Mapping[str, int], author: str, seq: int) -> bool:
    """Whether a group-done notice's id may become a want here: a group key, and a seq no
    further than the highest group seq known (`group_ceilings`) plus OFFER_SLACK. A member
    naming rounds far ahead (that no one will ever serve) would otherwise fill catch-up with
    wants that end counted lost."""
    if not is_group_key(author) or seq < 1:
        return False
    return seq <= group_ceilings(known, [author])[author] + OFFER_SLACK
