"""Who co-signed the learner groups' updates a replica applied: a member's share of the record.

With learner groups the authors of applied updates are group keys (`groups.0b01`), not peers,
so a peer's applied track record (dht.vouchers, dht.realign) would be empty for every member.
A group update carries its included members' signed contribution headers and one
co-signature per shard by a reducer, every included member co-signing at least its own
shard (merge.group_update, merge.group_plan.ShardPlan.reducers); the merge checks all of
them before it applies the update. So each applied group update is credited here to its
co-signers, per group key: a member's count under a key is how many of that key's applied
updates it co-signed. A member cannot claim an update it did not co-sign, and a fresh key
has nothing here.

It is a function of the applied set (each id applied once, one variant: merge.equivocation's
GroupVariants counts a second), and so alike on replicas that applied one set, because it
travels with the replica's state (a newcomer's download, a realignment, a checkpoint):
`Replica.state_dict`'s "cosigned". A credit is taken when the id is recorded, whatever its
robust weight (verdicts may differ between replicas; the applied set does not). A state
without it (an older node's) loads an empty ledger. It also decides whether a group key
votes on the learner floor on its own (`cosigners`: most of its co-signers counted in
merge.contribution, merge.group_pipeline.floor_votes), and bounds a donor's accounts of
members in a handover (merge.handover). Thread-safe (its own lock: the swarm's
loop reads it while the merge's thread applies).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

Counts = dict[str, dict[str, int]]
"""Per member, per group key: the applied updates of that key it co-signed."""


class CosignLedger:
    """Per member and group key, the applied group updates it co-signed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counts = {}
        self._cosigners: dict[str, set[str]] = {}
        """Per group key, the members with a count under it (`cosigners`)."""

    def credit(self, group_key: str, cosigners: Iterable[str]) -> None:
        """One applied update of `group_key`, co-signed by `cosigners` (each counted once)."""
        with self._lock:
            for member in set(cosigners):
                keys = self._counts.setdefault(member, {})
                keys[group_key] = keys.get(group_key, 0) + 1
                self._cosigners.setdefault(group_key, set()).add(member)

    def debit(self, group_key: str, cosigners: Iterable[str]) -> None:
        """Takes back `credit`'s count of one update of `group_key` (its variant withdrawn:
        merge.group_equivocation), so the ledger stays that of the applied contributions."""
        with self._lock:
            for member in set(cosigners):
                keys = self._counts.get(member, {})
                if keys.get(group_key, 0) > 1:
                    keys[group_key] -= 1
                else:
                    keys.pop(group_key, None)
                    self._forget(group_key, member)
                    if not keys:
                        self._counts.pop(member, None)

    def count(self, member: str) -> int:
        """The applied group updates `member` co-signed, all keys together."""
        with self._lock:
            return sum(self._counts.get(member, {}).values())

    def cosigners(self, group_key: str) -> frozenset[str]:
        """The members that co-signed any applied update of `group_key` (what decides whether
        the key votes on the learner floor on its own: merge.group_pipeline.floor_votes)."""
        with self._lock:
            return frozenset(self._cosigners.get(group_key, ()))

    def _forget(self, group_key: str, member: str) -> None:
        members = self._cosigners.get(group_key)
        if members is not None:
            members.discard(member)
            if not members:
                del self._cosigners[group_key]

    def counts(self) -> Counts:
        """A copy: per member, per group key, the applied updates it co-signed."""
        with self._lock:
            return {member: dict(keys) for member, keys in self._counts.items()}

    def load(self, counts: Counts) -> None:
        """Replaces everything by `counts` (from `parse_cosigned`)."""
        with self._lock:
            self._counts = {member: dict(keys) for member, keys in counts.items()}
            self._cosigners = {}
            for member, keys in self._counts.items():
                for key in keys:
                    self._cosigners.setdefault(key, set()).add(member)


def parse_cosigned(state: object, applied: Mapping[str, set[int]]) -> Counts:
    """A state's "cosigned" (None: a state from before it, empty), checked against the applied
    set it came with (ValueError): members and group keys are strings, each count a positive
    integer at most the key's updates in the applied set, so a donor can credit no member
    with more updates of a key than the state says were applied."""
    if state is None:
        return {}
    if not isinstance(state, Mapping):
        raise ValueError("replica state 'cosigned' must map members to group keys' counts.")
    counts: Counts = {}
    for member, keys in state.items():
        if not isinstance(member, str) or not isinstance(keys, Mapping):
            raise ValueError("replica state 'cosigned' must map members to group keys' counts.")
        for key, count in keys.items():
            if not isinstance(key, str) or type(count) is not int:
                raise ValueError(f"replica state 'cosigned' has an invalid count for {member}.")
            if not 1 <= count <= len(applied.get(key, ())):
                raise ValueError(f"replica state 'cosigned' credits {member} beyond {key}'s.")
        counts[member] = dict(keys)
    return counts
