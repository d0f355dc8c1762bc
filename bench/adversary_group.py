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

POLL_S = 0.1
NOTICE_TIMEOUT_S = 5.0
OPEN_WAIT_S = 2.0
"""How long after the first honest part of a round the adversary waits for the other honest
members' parts before it publishes its variant of that round."""
PUSH_AFTER_S = 20.0
"""How long past its class's end the adversary waits to push its last variant."""
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


def sideways(honest: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A step as long as `honest` in a random direction orthogonal to it: no robust check that
    reads a norm or a direction against the swarm's momentum refuses it (the reversed honest
    step rogue24 sent was applied at weight 0, `against_momentum`), and where a replica keeps
    it its params move away from every replica that keeps the honest round."""
    noise = torch.randn(honest.numel(), generator=torch.Generator().manual_seed(seed))
    unit = honest / honest.norm().clamp_min(1e-12)
    noise = noise - (noise @ unit) * unit
    return noise / noise.norm().clamp_min(1e-12) * honest.norm()


class GroupAttacks(AdversaryPeer):
    """A member of a learner group that publishes its own variant of each of the group's rounds."""

    member = False
    """True: heartbeats say "training", so honest nodes count this peer in their group census."""
    push_members = True
    """Push each lone variant whole to its group's honest members once they hold their own
    (bench.adversary --no-lone-push: notices only)."""
    lone_published: list[UpdateId]
    lone_pushed: list[UpdateId]
    _opened: dict[tuple[str, int], float]

    def group_lone_variant(self) -> int:
        """Lone variants of the rounds of this peer's group, for `duration_s` or until every
        honest node reports `until_round`; returns how many were published. Each is published
        once the honest members' round of the same id is open (`_round_open`), and, with
        `push_members`, pushed whole to the group's honest members once this replica applied
        their round (`_push_met`): every honest member then holds both variants of one id."""
        self.lone_published, self.lone_pushed, self._opened = [], [], {}
        run_id = self.node.config.run_id
        epoch_rounds = self.node.config.group_epoch_rounds
        me = self.node.peer_id
        deadline = time.monotonic() + self.duration_s
        done_for: set[UpdateId] = set()
        pending: dict[UpdateId, bytes] = {}
        while time.monotonic() < deadline and not self._honest_reached():
            self._push_met(pending, run_id)
            target = self._next_round(run_id, me, done_for)
            if target is None:
                time.sleep(POLL_S)
                continue
            key, seq, honest = target
            round_ = seq - 1  # the round after the applied one (its update's seq is round + 1)
            epoch = round_ // epoch_rounds
            parts = self._round_open(run_id, key, epoch, round_)
            if parts is None:
                time.sleep(POLL_S)
                continue
            done_for.add((key, seq))
            tensor = sideways(honest.aggregate.to(torch.float32), seed=seq)
            update = lone_variant(
                self.node.identity, run_id, honest, round_, epoch, tensor,
                self.node.replica.num_applied,
            )  # fmt: skip
            pending[(key, seq)] = self._publish(update, run_id)
            self.lone_published.append((key, seq))
            self.emit(
                "lone_variant", group_key=key, seq=seq, round=round_, parts=sorted(parts),
                at=time.time(),
            )  # fmt: skip
        until = time.monotonic() + PUSH_AFTER_S  # the last round's: once this replica has it
        while pending and time.monotonic() < until:
            self._push_met(pending, run_id)
            time.sleep(POLL_S)
        return len(self.lone_published)

    def _round_open(self, run_id: str, key: str, epoch: int, round_: int) -> set[str] | None:
        """The honest members whose parts of round `round_` of group `key` reached this peer
        (a listed member: they send it theirs), once every live honest peer inside the group
        sent one or OPEN_WAIT_S passed since the first (each of them is then collecting the
        round: a notice now reads "adopt" there, not "offer"); None before the first."""
        exchange = getattr(getattr(self.node.parts.swarm, "_network", None), "_groups", None)
        if exchange is None or exchange.highest_round.get(key, -1) < round_:
            return None
        held = set(exchange._held.get((key, epoch, round_), {}))
        inside = {h.peer_id for h in self.honest() if member_check(run_id, key)(h.peer_id)}
        first = self._opened.setdefault((key, round_), time.monotonic())
        if inside <= held or time.monotonic() - first >= OPEN_WAIT_S:
            return held
        return None

    def _push_met(self, pending: dict[UpdateId, bytes], run_id: str) -> None:
        """Each lone variant whose id this replica has applied (the honest members' variant:
        the adversary never applies its own), pushed whole on `group-update` to the honest
        peers inside its group, which hold the honest variant: both variants of one id meet
        at each (merge.pipeline `submit_group`: `group_equivocation`, a proof)."""
        if not self.push_members:
            return
        replica = self.node.replica
        for (key, seq), blob in list(pending.items()):
            with replica.lock:
                met = seq in replica.applied.get(key, ())
            if not met:
                continue
            del pending[(key, seq)]
            peers = [h.peer_id for h in self.honest() if member_check(run_id, key)(h.peer_id)]
            sent = self._send_all(peers, "group-update", blob)
            self.lone_pushed.append((key, seq))
            self.emit("lone_pushed", group_key=key, seq=seq, peers=len(peers), sent=sent)

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

    def _publish(self, update: GroupUpdate, run_id: str) -> bytes:
        """Held and served as a completing member holds its round (the gossip's retained copy
        and holder record), and told to every honest peer with a signed group-done notice;
        returns its wire bytes."""
        blob = encode_update(update)
        self.served[(update.head.group_key, update.head.round + 1)] = {None: blob}
        self.call(self.swarm.gossip.retain_group(update, blob), 30.0)
        notice = SignedDone.of(Done.of(update), self.node.identity, run_id).to_bytes()
        self._send_all([h.peer_id for h in self.honest()], "group-done", notice)
        return blob

    def _send_all(self, peers: list[str], name: str, blob: bytes) -> int:
        """`blob` to each of `peers`' `name` handler at once; how many sends went out."""

        async def send() -> list[object]:
            sends = (self.net.send(p, name, blob, timeout_s=NOTICE_TIMEOUT_S) for p in peers)
            return await asyncio.gather(*sends, return_exceptions=True)

        results = self.call(send(), 30.0)
        return sum(not isinstance(r, BaseException) for r in results)
