"""A dishonest member of a learner group, on the real protocol (issue 22 must-have 3).

`group_lone_variant`: the adversary's heartbeat says it trains, so the honest members count it
in their census and its key, inside their group's prefix (one group of every peer at the
bench's size; at a split any key is inside some group's prefix), is a member of their round.
It contributes nothing to the honest rounds. For each round its group opens, as soon as the
group's previous round is applied at the adversary's own replica, it completes a lone variant
of that round: itself the only included member and reducer (`GroupReduction`, the builder the
honest members use), its contribution the honest previous aggregate reversed (as long as an
honest step, pointing back), co-signed by itself. It retains that update under the round's id
(`Gossip.retain_group`: the holder record and the served copy an honest member's round
writes) and sends each honest peer the signed `group-done` notice an honest member sends
(`SignedDone`), so an honest member whose round is still running fetches and may adopt it,
and a peer outside the round offers it to its catch-up. Decision logic stays in merge/ and
dht/: this only builds and sends with their classes.

What a user cares about (bench.attack_group reads it from the honest nodes' events): no honest
replica keeps the lone variant's step, the honest round prevails where both met (a
`GroupProof`: `equivocation_proven`), every honest replica ends at one applied set.
"""

from __future__ import annotations

import asyncio
import time

import torch

from bench.adversary_peer import AdversaryPeer
from dht.gossip_groups import is_group_key
from dht.group_notice import SignedDone
from dht.grouping import member_check
from dht.grouping_done import Done
from dht.grouping_wire import GroupMessageError, decode_update, encode_update
from merge.group_update import ContributionHeader, GroupReduction, GroupUpdate, RoundFields
from merge.identity import Identity

POLL_S = 0.25
NOTICE_TIMEOUT_S = 5.0
UpdateId = tuple[str, int]


def lone_variant(
    identity: Identity,
    run_id: str,
    honest: GroupUpdate,
    round_: int,
    epoch: int,
    tensor: torch.Tensor,
    base_applied: int,
) -> GroupUpdate:
    """A complete variant of `honest`'s group's round `round_` that includes only `identity`
    (its own member list, its own reducer, its own co-signature), with the learner count and
    tokens of the honest round before it."""
    head = honest.head
    me = identity.peer_id
    fields = RoundFields(
        run_id=run_id, group_key=head.group_key, epoch=epoch, round=round_,
        learners=head.learners, base_applied=base_applied, published_applied=base_applied,
    )  # fmt: skip
    header = ContributionHeader.of(tensor, identity, fields, max(head.tokens, 1))
    reduction = GroupReduction(group_key=head.group_key, epoch=epoch, round=round_, members=[me])
    reduction.contribute(header, tensor)
    reduction.close()
    reduction.cosign(me, identity.sign(reduction.statement(me)))
    outcome = reduction.outcome
    if not isinstance(outcome, GroupUpdate):
        raise RuntimeError(f"the lone variant did not complete: {outcome}")
    return outcome


class GroupAttacks(AdversaryPeer):
    """A member of a learner group that publishes its own variant of each of the group's rounds."""

    member = False
    """True: heartbeats say "training", so honest nodes count this peer in their group census."""
    lone_published: list[UpdateId]

    def group_lone_variant(self) -> int:
        """Lone variants of the rounds of this peer's group, for `duration_s` or until every
        honest node reports `until_round`; returns how many were published."""
        self.lone_published = []
        run_id = self.node.config.run_id
        epoch_rounds = self.node.config.group_epoch_rounds
        me = self.node.peer_id
        deadline = time.monotonic() + self.duration_s
        done_for: set[UpdateId] = set()
        while time.monotonic() < deadline and not self._honest_reached():
            target = self._next_round(run_id, me, done_for)
            if target is None:
                time.sleep(POLL_S)
                continue
            key, seq, honest = target
            round_ = seq - 1  # the round after the applied one (its update's seq is round + 1)
            done_for.add((key, seq))
            tensor = -honest.aggregate.to(torch.float32)
            update = lone_variant(
                self.node.identity, run_id, honest, round_, round_ // epoch_rounds, tensor,
                self.node.replica.num_applied,
            )  # fmt: skip
            self._publish(update, run_id)
            self.lone_published.append((key, seq))
            self.emit("lone_variant", group_key=key, seq=seq, round=round_, at=time.time())
        return len(self.lone_published)

    def _honest_reached(self) -> bool:
        if self.until_round is None:
            return False
        honest = self.honest()
        return bool(honest) and all(h.round >= self.until_round for h in honest)

    def _next_round(
        self, run_id: str, me: str, done_for: set[UpdateId]
    ) -> tuple[str, int, GroupUpdate] | None:
        """(group key, seq of its next round, its last applied update) for this peer's group,
        once that update is applied and retained here; None before."""
        replica = self.node.replica
        with replica.lock:
            applied = {a: max(seqs) for a, seqs in replica.applied.items() if seqs}
        for key, last in applied.items():
            if not is_group_key(key) or not member_check(run_id, key)(me):
                continue
            if (key, last + 1) in done_for:
                continue
            blob = self.swarm.gossip.retained.get((key, last))
            if blob is None:
                continue
            try:
                honest = decode_update(blob, replica.numel)
            except GroupMessageError:
                continue
            if me in {h.author for h in honest.contributions}:
                continue  # its own variant prevailed here: wait for the group's next round
            return key, last + 1, honest
        return None

    def _publish(self, update: GroupUpdate, run_id: str) -> int:
        """Held and served as a completing member holds its round (the gossip's retained copy
        and holder record), and told to every honest peer with a signed group-done notice."""
        blob = encode_update(update)
        self.served[(update.head.group_key, update.head.round + 1)] = {None: blob}
        self.call(self.swarm.gossip.retain_group(update, blob), 30.0)
        notice = SignedDone.of(Done.of(update), self.node.identity, run_id).to_bytes()
        peers = [h.peer_id for h in self.honest()]

        async def tell() -> list[object]:
            sends = (
                self.net.send(p, "group-done", notice, timeout_s=NOTICE_TIMEOUT_S) for p in peers
            )
            return await asyncio.gather(*sends, return_exceptions=True)

        results = self.call(tell(), 30.0)
        return sum(not isinstance(r, BaseException) for r in results)
