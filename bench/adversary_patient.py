"""The adversary's patient attack classes (issue 20): valid, signed updates and messages that
pass every check, kept up for --duration seconds or until every honest node reports
--until-round (bench.adversary runs them, with sybil_vouchers beside the one-shot classes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import torch

from bench.adversary_peer import AdversaryPeer
from dht.heartbeat import Heartbeat
from dht.ranges import to_ranges
from dht.records import owner_subkey
from dht.transport import encode_request
from merge.identity import Identity

ZERO_PERIOD_S = 0.25
"""zero_flood: seconds between two all-zero updates (an honest node publishes one a round)."""
SIDEWAYS_POLL_S = 0.5
"""sideways: how often it looks whether the honest nodes started another round."""
SIDEWAYS_CAP_SHARE = 1.5
"""sideways: the update's norm as a share of the norm bound (max_norm_to_median x median, as
this node sees it): above 1, so that every receiver clips it to exactly its own bound."""
SIDEWAYS_COSINE_MARGIN = 0.1
"""sideways: the cosine to this node's momentum sits this far above the refusal bound
(min_cosine): at 0.05, half the updates fell below it on the honest replicas (their momentum
holds the sideways updates, this one's does not) and were zeroed."""
SUMMARY_PERIOD_S = 0.5
"""summary_flood: seconds between two rounds of summaries (one to each honest node)."""
SUMMARY_IDS = 1 << 20
"""summary_flood: update ids the applied ranges name, and the retained ones (the parser's cap)."""
SYBIL_LEARNERS = 40
"""sybil_learners: Sybil authors, each claiming LEARNER_CLAIM learners."""
LEARNER_CLAIM = 1024
SYBIL_UPDATE_PERIOD_S = 2.0
"""sybil_learners: seconds between two rounds of updates (one per Sybil author)."""


class PatientAttacks(AdversaryPeer):
    """The patient classes, each a method returning what it sent."""

    def keep_up(self, act: Callable[[], int], period_s: float) -> int:
        """`act` once every `period_s` for `duration_s`, or until every honest node reports
        `until_round`; what it sent in all."""
        deadline = time.monotonic() + self.duration_s
        sent = 0
        while time.monotonic() < deadline and not self.honest_done():
            started = time.monotonic()
            sent += act()
            time.sleep(max(0.0, period_s - (time.monotonic() - started)))
        return sent

    def honest_done(self) -> bool:
        if self.until_round is None:
            return False
        honest = self.honest()
        return bool(honest) and all(h.round >= self.until_round for h in honest)

    def _sybil_beats(self, authors: list[Identity], seqs: dict[str, int]) -> int:
        """A training heartbeat of each Sybil author, naming the seq it published last."""
        key = f"{self.swarm.config.prefix}/peers"
        period = self.swarm.config.heartbeat_period_s

        async def store_all() -> list[object]:
            stores = [
                self.net.dht_store(
                    key, owner_subkey(a.peer_id),
                    Heartbeat(peer_id=a.peer_id, state="training", latest_seq=seqs[a.peer_id],
                              updates_published=seqs[a.peer_id], sent_at=time.time(),
                              heartbeat_period_s=period).sign(a),
                    4 * period,
                )
                for a in authors
            ]  # fmt: skip
            return await asyncio.gather(*stores, return_exceptions=True)

        return sum(not isinstance(r, BaseException) for r in self.call(store_all(), 60.0))

    def _offer_summary(self, held: dict[str, list[int]]) -> int:
        """A repair summary to every honest node: `held` applied here and retained."""
        ranges = to_ranges(held)
        blob = encode_request(applied=ranges, retained=ranges)

        async def send_all() -> list[object]:
            sends = [
                self.net.exchange(p, "summary", blob, max_bytes=1 << 20, timeout_s=20.0)
                for p in [h.peer_id for h in self.honest()]
            ]
            return await asyncio.gather(*sends, return_exceptions=True)

        return sum(not isinstance(r, BaseException) for r in self.call(send_all(), 60.0))

    def zero_flood(self) -> int:
        """Valid signed all-zero updates of one author (this one), four a second: each passes
        every check, and every one is a norm of 0 in the robust window's median."""
        zeros = torch.zeros(self.node.num_params)
        return self.keep_up(lambda: self.offer(self.seal(zeros)), ZERO_PERIOD_S)

    def sideways(self) -> int:
        """Updates at the norm cap (sent at SIDEWAYS_CAP_SHARE of it, clipped by each receiver
        to max_norm_to_median x its median) at a cosine to the momentum just above the refusal
        bound (min_cosine + margin), all along one fixed direction orthogonal to the momentum:
        never zeroed, and they add up instead of cancelling. One per honest round, an honest
        learner's pace: what a fair share of the merge lets through (a faster one is
        zero_flood's case, and at one a second it also drags the median up: 61x the clean
        loss in a 24-round run)."""
        robust = self.node.pipeline.robust.config
        cosine = min(robust.min_cosine + SIDEWAYS_COSINE_MARGIN, 1.0)
        generator = torch.Generator().manual_seed(11)
        side = torch.randn(self.node.num_params, generator=generator)
        published_at = [-1]

        def publish() -> int:
            honest_round = max((h.round for h in self.honest()), default=0)
            if honest_round <= published_at[0]:
                return 0
            published_at[0] = honest_round
            d = self.direction()
            across = side - (side @ d) * d
            across = across / across.norm().clamp_min(1e-12)
            unit = cosine * d + (1 - cosine**2) ** 0.5 * across
            norm = SIDEWAYS_CAP_SHARE * robust.max_norm_to_median * self.typical_norm()
            return self.offer(self.seal(unit * norm))

        return self.keep_up(publish, SIDEWAYS_POLL_S)

    def summary_flood(self) -> int:
        """Repair summaries of ~170 bytes naming 2^20 applied and 2^20 retained update ids
        (this node's, far ahead of what it published), sent to every honest node again and
        again within its summary budget: each one is walked id by id by the receiver."""
        first = self.next_seq() + 1000
        ids = [[first, first + SUMMARY_IDS - 1]]
        summary = encode_request(
            applied={self.node.peer_id: ids}, retained={self.node.peer_id: ids}
        )

        async def send_all() -> list[object]:
            sends = [
                self.net.exchange(p, "summary", summary, max_bytes=1 << 20, timeout_s=20.0)
                for p in [h.peer_id for h in self.honest()]
            ]
            return await asyncio.gather(*sends, return_exceptions=True)

        def send() -> int:
            return sum(not isinstance(r, BaseException) for r in self.call(send_all(), 60.0))

        self.emit("summary_bytes", num_bytes=len(summary))
        return self.keep_up(send, SUMMARY_PERIOD_S)

    def sybil_learners(self) -> int:
        """SYBIL_LEARNERS Sybil authors, each with a live signed heartbeat, publish valid small
        updates along the momentum claiming LEARNER_CLAIM learners each: the learner floor
        then sizes every honest update as a share of a far larger swarm. The updates are
        pushed by this node and offered in its repair summaries (a Sybil key has no host)."""
        authors = self.sybils[-SYBIL_LEARNERS:]  # the last: bad_heartbeats signs with the first
        seqs = dict.fromkeys((s.peer_id for s in authors), 0)
        self._sybil_beats(authors, seqs)
        time.sleep(2 * self.swarm.config.heartbeat_period_s)  # honest nodes read them

        def publish() -> int:
            sent = 0
            for author in authors:
                seqs[author.peer_id] += 1
                update = self.seal(
                    self.benign(0.25), identity=author, seq=seqs[author.peer_id],
                    learners=LEARNER_CLAIM,
                )  # fmt: skip
                sent += self.offer(update)
            self._sybil_beats(authors, seqs)
            self._offer_summary({a: list(range(1, n + 1)) for a, n in seqs.items()})
            return sent

        return self.keep_up(publish, SYBIL_UPDATE_PERIOD_S)
