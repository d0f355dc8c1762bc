"""Learner groups at a round's end (`--group-size`, docs/scale.md's wiring plan step 4): this
node's pseudo-gradient becomes its signed contribution to its group's round instead of an
update of its own.

`GroupPublishing` is the `RoundPublishing` for groups (node.publishing holds the one for
whole updates, node.fragment_publishing the one for fragments). At each round's end it
decides the epoch's grouping (dht.grouping_view.EpochGrouping, from the live peers and the
bits they announce), signs a `ContributionHeader` and hands it to `SwarmLink.contribute`,
which runs the group's round (dht.group_exchange; `OfflineSwarm` completes a group of one).
A complete group update that includes this node is applied here (merge.pipeline
`submit_group`) and announced by its members to the rest of the swarm, which fetch it once
(dht.group_exchange `group-done`); an abandoned round, or one that left this node out, keeps
its pseudo-gradient in the error feedback buffer, so it joins the next round's contribution.
The part travels in this node's codec (`part_codec`) and signs what the others decode; what
the codec rounded off stays in the error feedback too.

What every member of a round signs alike (merge.group_update.RoundFields) is the group's
round: the round number (a node behind its group's joins the group's round,
`SwarmLink.group_round`), its epoch, and the learner count (non-empty groups). Each member
also signs its own replica's applied counts at its round's start and now: the group update's
staleness is their median (merge.group_pipeline).

A round this node gave up on (abandoned at its co-signature deadline, its contribution kept)
may have completed at the others with it included; when that update is applied here, the
contribution it carried is taken back out (merge.group_carry), so it is never counted twice.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from dht.grouping import Grouping, member_check
from dht.grouping_census import audible_members, healed_members
from dht.grouping_mode import RoundMode, forms_group, round_mode
from dht.grouping_view import EpochGrouping
from dht.grouping_wire import coded
from merge.codec_base import CodecError
from merge.codecs import get_codec
from merge.feedback import Compressor
from merge.group_carry import CarriedContributions, GroupFeedback
from merge.group_shards import sharded_contribution
from merge.group_update import Abandoned, ContributionHeader, GroupUpdate, RoundFields
from merge.pipeline import MergeConfig
from merge.result import MergeResult
from merge.shard_holders import folded
from node.events import EventLog
from node.learner import Learner, RoundStats, StepStats
from node.progress import RoundProgress
from node.publishing import Published, Publisher
from node.settings import GroupSettings
from node.swarm_link import GroupContribution

CARRY_CODEC = "int8"
"""A codec with error feedback: its Compressor's residual carries what no group applied and
what the part's codec rounded off (nothing is encoded with it: parts travel in the
publisher's codec, `part_codec`)."""


class GroupPublishing:
    """One contribution per round to this node's learner group; the group's update applied."""

    def __init__(
        self,
        publisher: Publisher,
        learner: Learner,
        merge: MergeConfig,
        groups: GroupSettings,
        run_id: str,
        events: EventLog | None = None,
        census_s: float = 30.0,
    ) -> None:
        """`census_s`: a peer whose heartbeat came within this many seconds counts in the
        census the grouping is decided from (longer than liveness: a peer whose heartbeats
        come late on a loaded machine does not move the groups)."""
        if publisher.replica.layout is not None:
            raise ValueError("--group-size needs whole updates (--fragments 1)")
        if groups.group_shard_fetch and not groups.group_scatter:
            raise ValueError("--group-shard-fetch needs --group-scatter")
        if groups.group_fold and not groups.group_shard_fetch:
            raise ValueError("--group-fold needs --group-shard-fetch")
        self.publisher, self.learner, self.merge = publisher, learner, merge
        self.replica, self.groups, self.run_id = publisher.replica, groups, run_id
        self.events, self.census_s = events, census_s
        self.grouping = EpochGrouping(
            run_id, groups.group_epoch_rounds, groups.grouping_config(), me=self.me
        )

        self.part_codec = publisher.codec.name
        """What this node's parts travel in: the swarm's codec for its own updates (bf16 by
        default; session 10 sent fp32, 2x the bytes). What it rounds off stays here."""
        self.published: list[Published] = []
        self.carried = CarriedContributions(publisher.identity.peer_id)
        """Contributions carried from rounds settled without this node (merge.group_carry)."""
        self.compressor = GroupFeedback(get_codec(CARRY_CODEC), self.replica.numel, self.carried)
        """The residual and the carried contributions (checkpointed together)."""
        publisher.pipeline.groups.on_applied.append(self.carried.applied)
        # the merge refuses a group update by its members' signed norms clipped as this run's
        # reduction clips them (merge.group_update.signed_norm_bound)
        publisher.pipeline.groups.reduction = groups.reduction_config()
        self.next_round = 0
        """The round this node contributes to next (unless its group is ahead)."""
        self.mode = RoundMode.GROUP
        """What the last grouping decision chose (dht.grouping_mode): SOLO publishes the
        round as this node's own update, as with groups off."""
        self._small_census = False
        """Whether the last decision's census was too small for a group (a node goes SOLO
        from the second such decision in a row)."""

    @property
    def me(self) -> str:
        return self.publisher.identity.peer_id

    def announced(self) -> tuple[int, int] | None:
        """(bits, epoch) of the grouping this node is in, for its heartbeat (None: none yet)."""
        current = self.grouping.current
        return None if current is None else (current.bits, current.epoch)

    def begin(self, partial: RoundProgress | None) -> RoundProgress:
        self.published = []
        if partial is not None and partial.params is not None:
            self.learner.load_params(partial.params)
            return partial
        with self.replica.lock:
            base, applied = self.replica.snapshot()
        self._take_back_owed()
        start = self.compressor.round_start(base)  # minus what no group has applied yet
        self.learner.load_params(start)
        return RoundProgress(start, applied)

    def on_step(self, step: int, stats: StepStats) -> None:
        """Nothing is exchanged during a round."""

    def finish(
        self, base: RoundProgress, stats: RoundStats, params: torch.Tensor | None = None
    ) -> None:
        """`params`: the round's end parameters when it was set aside (node.trainer)."""
        t_start = time.perf_counter()
        end = self.learner.params_vector() if params is None else params
        # The round's pseudo-gradient plus what earlier rounds left unapplied (the residual).
        total = base.base - end + self.compressor.residual
        owed = self.carried.take_owed()  # carried, then found in an update applied since
        if owed is not None:
            total -= owed
        sent, payload = self.coded(total)
        contribution = self.contribution(sent, stats.tokens, base.base_applied, payload)
        t_sealed = time.perf_counter()
        if contribution is None and self.mode is RoundMode.SOLO:  # too few for a group
            self.published.append(self._publish_own(total, sent, payload, base, stats))
            return
        if contribution is None:  # no group formed yet: what it trained waits for one
            self.compressor.residual = total.detach().clone()
            reason = "group_swarm_below_group_size"
            result = MergeResult(False, self.me, self.next_round + 1, 0, 0.0, reason)
            self.published.append(Published(result, 0, 0.0, t_sealed - t_start, 0.0))
            return
        outcome = self.publisher.swarm.contribute(contribution)
        self.next_round = contribution.header.round + 1
        result = self._settle(outcome, contribution.header, total, sent)
        t_merged = time.perf_counter()
        self._report(contribution, outcome, t_merged - t_sealed)
        num_bytes = (4 * total.numel() if payload is None else len(payload)) * (
            len(contribution.members) - 1
        )
        self.published.append(
            Published(result, num_bytes, 0.0, t_sealed - t_start, t_merged - t_sealed)
        )

    def coded(self, total: torch.Tensor) -> tuple[torch.Tensor, bytes | None]:
        """What this node's part carries of `total` (what the others decode: what it signs)
        and its payload in `part_codec`; `total` itself with no payload (fp32) when the
        codec is fp32 or cannot encode it (not finite: the round refuses it anyway)."""
        if self.part_codec == "fp32":
            return total, None
        try:
            return coded(total, self.part_codec)
        except CodecError:
            return total, None

    def _publish_own(
        self,
        total: torch.Tensor,
        sent: torch.Tensor,
        payload: bytes | None,
        base: RoundProgress,
        stats: RoundStats,
    ) -> Published:
        """The round as this node's own signed update (a swarm too small for a group:
        dht.grouping_mode), in the part codec; what it rounded off, or all of `total` when
        the merge refused it, stays in the residual."""
        codec = get_codec(self.part_codec if payload is not None else "fp32")
        encoded = payload if payload is not None else codec.encode(sent)
        work = (stats.num_steps, stats.tokens, stats.loss)
        published = self.publisher.publish(
            sent, lambda _: encoded, base.base_applied, work, codec=codec
        )
        kept = total - sent if published.result.accepted else total
        self.compressor.residual = kept.detach().clone()
        return published

    def _take_back_owed(self) -> None:
        """Out of the residual: what it carried that an update applied since included."""
        owed = self.carried.take_owed()
        if owed is not None:
            self.compressor.residual = self.compressor.residual - owed

    def contribution(
        self,
        total: torch.Tensor,
        tokens: int,
        base_applied: int = 0,
        payload: bytes | None = None,
    ) -> GroupContribution | None:
        """This node's signed contribution to its group's next round; None while the swarm
        it sees, at a grouping's decision, is smaller than one group (`self.mode`,
        dht.grouping_mode: a node alone, a founder or one that has not read its peers'
        heartbeats yet, forms no group of its own whose update the peers joining next would
        never get; two peers form no group either member could void: each publishes its
        own update)."""
        swarm = self.publisher.swarm
        alive = [
            s.heartbeat
            for s in swarm.sightings(time.time())
            if s.last_seen_s <= self.census_s
            and s.heartbeat.peer_id != self.me
            and s.heartbeat.state != "idle"  # done training: contributes no more
        ]
        previous = self.grouping.current
        round_ = self.next_round
        if previous is not None:
            round_ = max(round_, swarm.group_round(previous.group_of(self.me) or ""))
        census = [self.me, *(h.peer_id for h in alive)]
        if self.grouping.due(round_):  # too few for a group: its own update, or wait
            grouped = sum(1 for h in alive if h.group_bits is not None)
            small_before = self._small_census
            self._small_census = not forms_group(len(census), self.groups.group_size)
            size = self.groups.group_size
            self.mode = round_mode(len(census), size, grouped, small_before)
            if self.mode is not RoundMode.GROUP:
                self.grouping.leave()  # announces no grouping while it has none
                return None
        announced = {h.peer_id: h.group_bits for h in alive if h.group_bits is not None}
        grouping = self.grouping.decide(round_, census, announced)
        if grouping is None:  # its census does not bear its peers' split yet (grouping_split)
            return None
        key = grouping.group_of(self.me)
        assert key is not None  # this node is in its own census
        round_ = max(round_, self._group_round(key))
        if self.grouping.due(round_):  # its group is in a later epoch: that epoch's grouping
            grouping = self.grouping.decide(round_, census, announced) or grouping
            key = grouping.group_of(self.me) or key
            round_ = max(round_, self._group_round(key))
        epoch = self.grouping.epoch_of(round_)
        members = self._members(grouping, key, epoch, round_, census)
        fields = RoundFields(
            run_id=self.run_id,
            group_key=key,
            epoch=epoch,
            round=round_,
            learners=grouping.num_learners,
            base_applied=base_applied,
            published_applied=max(base_applied, self.replica.progress),
        )
        digests: tuple[str, ...] = ()
        if self.groups.group_scatter:  # signs its shards' digests (merge.group_shards)
            header, digests = sharded_contribution(
                total, self.publisher.identity, fields, max(tokens, 1), len(members)
            )
        else:
            header = ContributionHeader.of(total, self.publisher.identity, fields, max(tokens, 1))
        wait = self.groups.group_wait
        return GroupContribution(
            identity=self.publisher.identity,
            header=header,
            pseudo_gradient=total,
            members=members,
            wait_s=wait,
            cosign_s=wait,
            config=self.groups.reduction_config(),
            codec="fp32" if payload is None else self.part_codec,
            payload=payload,
            digests=digests,
        )

    def _group_round(self, key: str) -> int:
        """The round of group `key` this node contributes to at the earliest: the highest a
        member's part was seen for, and the round after the last of the group's updates this
        replica applied (its seq is round + 1). A node restarted behind its group learns the
        group's round from its replica even when no member sends it a part (session 13: a
        restarted node's parts for rounds 0-3 were refused by a group at round 10, which had
        decided its next epoch without it and so never sent it one)."""
        return max(self.publisher.swarm.group_round(key), self.replica.last_seq(key))

    def _members(
        self, grouping: Grouping, key: str, epoch: int, round_: int, census: list[str]
    ) -> tuple[str, ...]:
        """The round's member list: the epoch's decided list joined by the live peers inside
        the group that sent this node a signed part for the epoch, so a list that differs
        from the other members' heals within one round, less the members silent here on
        both channels (no heartbeat in the census, nothing sent for `QUIET_ROUNDS` rounds:
        a dead member leaves every member's list alike; dht.grouping_census)."""
        swarm = self.publisher.swarm
        senders = swarm.group_senders(key, epoch) if grouping.epoch == epoch else {}
        healed = healed_members(grouping.members[key], senders, member_check(self.run_id, key))
        first = epoch * self.grouping.epoch_rounds
        return audible_members(healed, self.me, census, senders, round_, first)

    def _report(
        self, contribution: GroupContribution, outcome: GroupUpdate | Abandoned, seconds: float
    ) -> None:
        """One `group_round` event: the round, its group, who was included, or why not."""
        if self.events is None:
            return
        header = contribution.header
        included = (
            [h.author for h in outcome.contributions] if isinstance(outcome, GroupUpdate) else []
        )
        self.events.emit(
            "group_round",
            round=header.round,
            epoch=header.epoch,
            group_key=header.group_key,
            members=len(contribution.members),
            included=included,
            outcome="completed" if isinstance(outcome, GroupUpdate) else outcome.reason,
            seconds=round(seconds, 3),
        )

    def _settle(
        self,
        outcome: GroupUpdate | Abandoned,
        header: ContributionHeader,
        total: torch.Tensor,
        sent: torch.Tensor,
    ) -> MergeResult:
        """Applies a complete update here; keeps `total` for next round unless `sent` (what
        the part carried of it) is in one, and then what the codec rounded off."""
        included = isinstance(outcome, GroupUpdate) and any(
            h.author == self.me for h in outcome.contributions
        )
        if included:
            self.compressor.residual = (total - sent).detach()
        else:
            self.compressor.residual = total.detach().clone()
            self.carried.carry(header, sent)
        if isinstance(outcome, GroupUpdate) and folded(outcome, self.replica.numel):
            # --group-fold: the fetch round applies it with the others (its MergeResult is
            # that round's, node.network_swarm `report_merge`); nothing to apply now
            return MergeResult(
                False, header.group_key, header.round + 1, 0, 0.0, "group_folded"
            )  # fmt: skip
        if isinstance(outcome, GroupUpdate):
            pipeline = self.publisher.pipeline
            result = pipeline.submit_group(outcome, member_check(self.run_id, header.group_key))
            if result.reason == "group_equivocation":  # a variant of this round came first
                self.publisher.swarm.pass_on_evidence(outcome)  # rogue25: no proof went out
            self.publisher.report_merge(result)
            return result if included else MergeResult(
                False, header.group_key, header.round + 1, 0, 0.0, "group_left_out"
            )  # fmt: skip
        return MergeResult(
            False, header.group_key, header.round + 1, 0, 0.0, f"group_{outcome.reason}"
        )

    def flush(self) -> Published | None:
        """Nothing: what no group applied stays with this node (no round to carry it)."""
        return None

    def interrupted(self, done: RoundProgress) -> RoundProgress | None:
        """Not contributed; kept (and checkpointed) to be finished later."""
        params = self.learner.params_vector()
        return replace(done, params=params) if done.steps_done else None

    def holds_learner_params(self) -> bool:
        return False

    def keeps_partial_rounds(self) -> bool:
        return True

    def error_feedback(self) -> Compressor:
        return self.compressor
