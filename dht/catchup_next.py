"""CatchUp's decisions of what to do next (dht.catchup): the fetches to start and from which
source, the wants no live peer offers any more (lost, or waiting for a state), the authors whose
holder records to look up, the peers to ask for a summary. A part of
:class:`dht.catchup.CatchUp` (a mixin: the same methods, moved out of dht/catchup.py unchanged
in session 25; they read its tables).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence

from dht.catchup_config import CatchUpConfig
from dht.catchup_state import AppliedSet, StateWants
from dht.catchup_wants import Fetch, Want
from dht.fetch_order import FetchOrder
from dht.ranges import UpdateId

RELAYED_RANK = 1
"""source_rank of a peer on a relayed connection (dht.reachability.path_rank)."""
MAX_NEWLY_STALLED = 16
"""Stalls kept for the caller between its reports (it reports and clears them each poll)."""


class Deciding:
    """CatchUp's next steps: what to fetch from whom, what is lost, whom to ask."""

    # what it reads of CatchUp (dht.catchup), which sets or defines each
    config: CatchUpConfig
    self_id: str
    fetch_order: FetchOrder
    is_fresh: Callable[[str], bool]
    source_rank: Callable[[str], int]
    held_back: Callable[[UpdateId, Sequence[str]], bool]
    state_wants: StateWants
    _applied: AppliedSet
    _wants: dict[UpdateId, Want]
    _mismatch_since: dict[str, float]
    _last_summary: dict[str, float]
    _holder_lookup_at: dict[str, float]
    _last_poll: float | None
    num_stalls: int
    stalled_s: float
    newly_stalled: list[float]
    _drop: Callable[[UpdateId], None]
    _remember_lost: Callable[[UpdateId], None]
    _await_state: Callable[[UpdateId, float], None]
    _note_deferred: Callable[[UpdateId], None]

    # ---- what the node does next --------------------------------------------------------------

    def next_fetches(self, now: float, alive: set[str]) -> list[Fetch]:
        """Fetches to start now, at most max_in_flight running: established authors' wants
        first, fresh authors' within their caps (dht.fetch_order); each author's lowest seqs
        first. A fresh want over its author's cap stays wanted (deferred, noted once)."""
        running = [uid for uid, want in self._wants.items() if want.in_flight is not None]
        budget = self.config.max_in_flight - len(running)
        fresh_in_flight = sum(self.is_fresh(author) for author, _ in running)
        fetches: list[Fetch] = []
        if budget <= 0:
            return fetches
        with_fresh = self.fetch_order.may_admit(now, fresh_in_flight)
        direct = self._direct_peers(alive)
        for uid in self.fetch_order.order(self._wants, self.is_fresh, with_fresh=with_fresh):
            if budget <= 0:
                break
            want = self._wants[uid]
            if self.held_back(uid, self._live_sources(want, alive)):
                continue
            peer_id = self._pick_source(uid, now, alive, direct)
            if peer_id is None:
                continue
            fresh = self.is_fresh(uid[0])
            if fresh and not self.fetch_order.admit(uid[0], now, fresh_in_flight):
                if not want.deferred:
                    want.deferred = True
                    self._note_deferred(uid)
                continue
            want.in_flight = peer_id
            fetches.append(Fetch(uid[0], uid[1], peer_id, want.origin))
            fresh_in_flight += fresh
            budget -= 1
        return fetches

    def declare_lost(self, now: float, alive: set[str]) -> list[UpdateId]:
        """Wanted updates that no live peer has offered for lost_after_s, and that no live peer
        serving state named applied for as long; no longer wanted. Those one did wait for a
        state (`newly_need_state`); those waiting whose namers went silent are lost now. A gap
        since the last poll over stall_s does not count toward any of these waits."""
        config = self.config
        self._skip_stall(now)
        lost = self.state_wants.sweep(now, self._applied, config.lost_after_s)
        for uid in lost:
            self._remember_lost(uid)
        for uid, want in list(self._wants.items()):
            if self._applied.has_applied(*uid):
                self._drop(uid)
                continue
            if want.in_flight is not None or self._live_sources(want, alive):
                want.sourceless_since = None
                continue
            if want.sourceless_since is None:
                want.sourceless_since = now
            elif now - want.sourceless_since >= config.lost_after_s:
                self._drop(uid)
                named_at = want.applied_named_at
                if named_at is not None and now - named_at < config.lost_after_s:
                    self._await_state(uid, named_at)
                    continue
                self._remember_lost(uid)
                lost.append(uid)
        return lost

    def _skip_stall(self, now: float) -> None:
        """Moves every wait on by the gap since the last poll when it is over stall_s: time this
        node did not run, when it could neither fetch nor hear a peer's summary."""
        last, self._last_poll = self._last_poll, now
        gap = 0.0 if last is None else now - last
        if self.config.stall_s <= 0 or gap <= self.config.stall_s:
            return
        self.num_stalls += 1
        self.stalled_s += gap
        if len(self.newly_stalled) < MAX_NEWLY_STALLED:
            self.newly_stalled.append(gap)
        for want in self._wants.values():
            if want.sourceless_since is not None:
                want.sourceless_since += gap
            if want.applied_named_at is not None:
                want.applied_named_at += gap
        self.state_wants.shift(gap)

    @property
    def num_need_state(self) -> int:
        """Wanted updates that only a live peer's state brings (not lost)."""
        return len(self.state_wants)

    def holder_lookups(self, now: float, alive: set[str]) -> list[str]:
        """Authors whose wanted updates have no live source: look up their holder records."""
        authors = set()
        for (author, _), want in self._wants.items():
            if want.in_flight is None and not self._live_sources(want, alive):
                authors.add(author)
        due = [
            a
            for a in sorted(authors)
            if now - self._holder_lookup_at.get(a, -1e18) >= self.config.retry_s
        ]
        for author in due:
            self._holder_lookup_at[author] = now
        return due

    def summary_peers(
        self,
        now: float,
        own_digest: str,
        digests: Mapping[str, str],
        preferred: Container[str] = (),
    ) -> list[str]:
        """Live peers whose applied digest has differed from ours long enough to compare notes:
        at most max_summaries, `preferred` peers first (those that contributed updates: a
        crowd of fresh keys cannot starve them), then the least recently asked."""
        candidates: list[str] = []
        for peer_id, digest in digests.items():
            if digest == own_digest:
                self._mismatch_since.pop(peer_id, None)
                continue
            since = self._mismatch_since.setdefault(peer_id, now)
            last = self._last_summary.get(peer_id, -1e18)
            if (
                now - since >= self.config.mismatch_grace_s
                and now - last >= self.config.summary_period_s
            ):
                candidates.append(peer_id)
        candidates.sort(key=lambda p: (p not in preferred, self._last_summary.get(p, -1e18), p))
        due = candidates[: self.config.max_summaries]
        for peer_id in due:
            self._last_summary[peer_id] = now
        return due

    @property
    def num_wanted(self) -> int:
        return len(self._wants)

    def wanted(self) -> list[UpdateId]:
        return sorted(self._wants)

    # ---- the source of a fetch ----------------------------------------------------------------

    def _live_sources(self, want: Want, alive: set[str]) -> list[str]:
        return sorted(s for s in want.sources if s in alive)

    def _retry_wait_s(self, uid: UpdateId, source: str, want: Want) -> float:
        """How long after its last failure `source` may be asked for `uid` again."""
        if source != uid[0] or want.author_failures <= 1:
            return self.config.retry_s
        doubled = self.config.retry_s * 2.0 ** min(want.author_failures - 1, 30)
        return max(self.config.retry_s, min(self.config.max_retry_s, doubled))

    def _pick_source(
        self, uid: UpdateId, now: float, alive: set[str], direct: set[str]
    ) -> str | None:
        """The best ready source: the one on the best connection (source_rank), the author
        among equals. Behind NAT an author on a relayed connection is a home on a thin
        uplink, reached through a relay that may cut every 128 KiB: a holder on a direct
        connection (the public node that merged it) serves it in a fraction of the time and
        leaves the author's uplink to the peers that have no other source (bench.chaos
        --topology nat: 0.9 MB took 12-15 s relayed from a home, 0.5-0.9 s direct from the
        public node that held it)."""
        want = self._wants[uid]
        if want.in_flight is not None or self._applied.has_applied(*uid):
            return None
        ready = [
            s
            for s in self._live_sources(want, alive)
            if now - want.failed_at.get(s, -1e18) >= self._retry_wait_s(uid, s, want)
        ]
        if not ready:
            return None
        best = min(ready, key=lambda s: (self.source_rank(s), s != uid[0], s))
        if self.source_rank(best) != RELAYED_RANK:
            return best
        # relay_patience_s: a direct peer will likely hold it soon
        return None if self._direct_peer_may_offer(want, now, direct) else best

    def _direct_peers(self, alive: set[str]) -> set[str]:
        """The live peers on a direct connection (source_rank 0), for relay_patience_s."""
        if self.config.relay_patience_s <= 0:
            return set()
        return {p for p in alive if p != self.self_id and self.source_rank(p) == 0}

    def _direct_peer_may_offer(self, want: Want, now: float, direct: set[str]) -> bool:
        """Within relay_patience_s of `want`, whether a live peer on a direct connection that
        neither offers it yet nor failed to deliver it may (it fetches it, then serves it over
        its own link)."""
        if now - want.wanted_at >= self.config.relay_patience_s:
            return False
        return any(p not in want.sources and p not in want.failed_at for p in direct)
