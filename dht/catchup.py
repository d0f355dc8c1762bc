"""Catch-up and repair decisions, with no network: what to fetch, from whom, what is lost.

The swarm layer feeds this class what it hears (announced headers, holder records, peers'
per-author summaries, failed fetches) and asks it what to do next. Updates are identified by
(author, seq) and judged by membership in the replica's applied set, never by "seq <= last":
an update that arrives late, out of order or twice is applied exactly once. An update this
node wants but that no live peer holds for `lost_after_s` is declared lost (and counted by
the caller); it is wanted again if a holder shows up later. One that a live peer serving its
state named applied within `lost_after_s` is not lost but waits for a state
(dht.catchup_state). The config lives in dht.catchup_config; the decisions of what to do
next (fetches, their sources, lost updates, lookups) in dht.catchup_next.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, KeysView, Sequence

from dht.catchup_config import CatchUpConfig
from dht.catchup_next import Deciding
from dht.catchup_state import AppliedSet, StateWants
from dht.catchup_wants import Fetch, Learned, Want
from dht.fetch_order import FetchOrder
from dht.ranges import Ranges, UpdateId, iter_ids

__all__ = ["AppliedSet", "CatchUp", "CatchUpConfig", "Fetch", "Learned", "StateWants"]

SMALL_RANGE = 64
"""A holder record's range shorter than this is walked seq by seq; a longer one through the
author's wanted seqs."""


class CatchUp(Deciding):
    """The wanted updates of one node and the decisions about them; not thread-safe."""

    def __init__(
        self,
        config: CatchUpConfig,
        self_id: str,
        applied: AppliedSet,
        fetch_order: FetchOrder | None = None,
    ) -> None:
        self.config = config
        self.self_id = self_id
        self._applied = applied
        self.fetch_order = fetch_order or FetchOrder()
        self.is_fresh: Callable[[str], bool] = lambda author: False
        """Whether an author has no track record here (set by gossip from the merge's
        verdicts): its wants come after established authors' and are rate-capped."""
        self.source_rank: Callable[[str], int] = lambda peer_id: 0
        """How good this node's connection to a source is, lower first (set by the fetcher
        from dht.reachability.path_rank: direct or hole-punched 0, relayed 1, none 2)."""
        self.held_back: Callable[[UpdateId, Sequence[str]], bool] = lambda uid, sources: False
        """Whether a wanted update waits for another path, given its live sources (set by the
        group exchange with --group-shard-fetch: other groups' updates a fetch round may merge
        by slices, dht.group_exchange_candidates); it is fetched here once that says no more."""
        self.newly_deferred: list[UpdateId] = []
        """Fresh authors' updates passed over (by their fetch cap, for the first time, or
        because max_fresh_wants were wanted), for the caller to count and clear."""
        self._wants: dict[UpdateId, Want] = {}
        self._settled: dict[UpdateId, None] = {}
        """Updates fetched and refused for good, oldest first (bounded by max_wants)."""
        self._lost: dict[UpdateId, None] = {}
        """Lost updates, oldest first (at most max_lost)."""
        self.state_wants = StateWants(config.max_lost)
        """Updates no live peer serves that a live peer serving state applied (not lost)."""
        self.newly_need_state: list[UpdateId] = []
        """Wanted updates moved to state_wants, for the caller to report and clear."""
        self._deferred: dict[UpdateId, None] = {}
        """Fresh updates counted as passed over (newly_deferred), oldest first."""
        self.num_recovered = 0
        self._last_poll: float | None = None
        """When declare_lost last ran (stall_s measures the gap from it)."""
        self.num_stalls = 0
        """Polls that came over stall_s after the last one: waits moved on by the gap."""
        self.stalled_s = 0.0
        """Seconds of those gaps, in all."""
        self.newly_stalled: list[float] = []
        """Gaps (seconds) of stalls not yet reported, for the caller to report and clear (at
        most MAX_NEWLY_STALLED kept between reports)."""
        self._max_seen: dict[str, int] = {}
        self._mismatch_since: dict[str, float] = {}
        self._last_summary: dict[str, float] = {}
        self._holder_lookup_at: dict[str, float] = {}
        self._named_by: dict[str, int] = {}
        """Wanted updates per peer whose summary named them."""
        self._num_fresh_wants = 0

    @property
    def lost(self) -> KeysView[UpdateId]:
        """Updates declared lost and not wanted since (the newest max_lost)."""
        return self._lost.keys()

    # ---- what the node hears ------------------------------------------------------------------

    def announced(
        self,
        author: str,
        seq: int,
        header: object | None,
        now: float,
        holder: str | None = None,
        cause: str | None = None,
    ) -> bool:
        """An update exists and `holder` (the author when None) holds it; True when newly wanted.
        `cause`: why (the want's origin from now on; "announced" when None)."""
        self._max_seen[author] = max(seq, self._max_seen.get(author, 0))
        new = self._want((author, seq), [holder or author], now, header, origin=cause)
        want = self._wants.get((author, seq))
        if cause is not None and want is not None:
            want.origin = cause
        return new

    def holders(self, author: str, seq: int, peer_ids: Iterable[str], now: float) -> None:
        """Peers that hold (author, seq), from a holder record."""
        self._want((author, seq), peer_ids, now, None, create=False)

    def held(self, author: str, holder: str, ranges: Iterable[tuple[int, int]], now: float) -> None:
        """`holder` retains `author`'s updates in `ranges` (its holder record): a source of
        those this node wants. Walks the ranges' wanted seqs, never the ranges' seqs: a record
        may name [1, 2^53] (at most dht.messages.MAX_HOLDER_RANGES ranges)."""
        wanted: list[int] | None = None
        for lo, hi in ranges:
            if hi - lo < SMALL_RANGE:
                seqs: Iterable[int] = range(lo, hi + 1)
            else:
                if wanted is None:
                    wanted = sorted(seq for a, seq in self._wants if a == author)
                seqs = wanted[bisect_left(wanted, lo) : bisect_right(wanted, hi)]
            for seq in seqs:
                self._want((author, seq), [holder], now, None, create=False)

    def summary(
        self,
        peer_id: str,
        applied: Ranges,
        retained: Ranges,
        now: float,
        *,
        serves_state: bool = True,
    ) -> Learned:
        """A peer's applied and retained ranges (walked id by id: dht.summary_bounds bounds
        them first); at most max_wants_per_peer of the updates wanted are this peer's. What a
        peer that `serves_state` applied and does not hold, its state brings: not lost."""
        held = set(iter_ids(retained))
        num_new = num_capped = num_unreachable = 0
        for uid in iter_ids(applied):
            if self._named_by.get(peer_id, 0) >= self.config.max_wants_per_peer:
                num_capped += not self.knows(uid)
            else:
                sources = [peer_id] if uid in held else []
                num_new += self._want(
                    uid, sources, now, None, revive=uid in held, named_by=peer_id, origin="summary"
                )
            if serves_state and uid not in held:
                self._named_applied(uid, now)
            num_unreachable += (uid in self._lost or uid in self.state_wants) and uid not in held
        for uid in held:
            self._want(uid, [peer_id], now, None, create=False, revive=True)
        self._last_summary[peer_id] = now
        return Learned(num_new, num_capped, num_unreachable)

    def fetched(self, uid: UpdateId, *, settled: bool = True) -> None:
        """The fetch of `uid` ended with an update merged or rejected for good."""
        want = self._wants.get(uid)
        if want is not None:
            want.in_flight = None
        if settled:
            self._drop(uid)
            if not self._applied.has_applied(*uid):
                self._settled[uid] = None
                if len(self._settled) > self.config.max_wants:  # forget the oldest
                    del self._settled[next(iter(self._settled))]

    def failed(self, uid: UpdateId, peer_id: str, now: float, *, refused: bool = False) -> None:
        """`peer_id` could not deliver `uid`: ask someone else, or it again after retry_s (if
        it claims it again). The author stays a source after a failure that was not a refusal
        ("not held"), asked again with backoff, up to author_retries failures in a row."""
        want = self._wants.get(uid)
        if want is None:
            return
        want.in_flight = None
        want.failed_at[peer_id] = now
        if peer_id == uid[0] and not refused:
            want.author_failures += 1
            if want.author_failures < self.config.author_retries:
                return
        want.sources.discard(peer_id)
        if not want.sources and want.sourceless_since is None:
            want.sourceless_since = now

    def knows(self, uid: UpdateId) -> bool:
        """True when `uid` is wanted, applied, settled, lost or waits a state: nothing new to
        learn about it."""
        return (
            uid in self._wants
            or uid in self._settled
            or uid in self._lost
            or uid in self.state_wants
            or self._applied.has_applied(*uid)
        )

    def forget_peer(self, peer_id: str) -> None:
        """`peer_id` left: drop what was kept about it as a peer and as an author.

        Kept: wanted updates (another peer may still hold them), lost ones (counted), and the
        applied set, which lives in the replica."""
        for table in (self._max_seen, self._mismatch_since, self._last_summary):
            table.pop(peer_id, None)
        self._holder_lookup_at.pop(peer_id, None)
        self._named_by.pop(peer_id, None)
        for want in self._wants.values():
            if want.named_by == peer_id:  # its share is freed; the wants stay
                want.named_by = None
        self._settled = {uid: None for uid in self._settled if uid[0] != peer_id}
        for want in self._wants.values():
            want.failed_at.pop(peer_id, None)
            if want.in_flight is None:
                want.sources.discard(peer_id)

    def num_tracked(self) -> int:
        """Entries kept in all tables: what bounded bookkeeping is measured by."""
        return (
            len(self._wants)
            + len(self._settled)
            + len(self._lost)
            + len(self.state_wants)
            + len(self.newly_need_state)
            + len(self.newly_stalled)
            + len(self._deferred)
            + len(self._max_seen)
            + len(self._mismatch_since)
            + len(self._last_summary)
            + len(self._holder_lookup_at)
            + len(self._named_by)
            + len(self.newly_deferred)
            + self.fetch_order.num_tracked()
        )

    def seen_seqs(self) -> dict[str, int]:
        """A copy of max_seen for every author heard of."""
        return dict(self._max_seen)

    def max_seen(self, author: str) -> int:
        """The highest seq of `author` this node has heard announced (0 if none)."""
        return self._max_seen.get(author, 0)

    # ---- internals ----------------------------------------------------------------------------

    def _want(
        self,
        uid: UpdateId,
        sources: Iterable[str],
        now: float,
        header: object | None,
        *,
        create: bool = True,
        revive: bool = False,
        named_by: str | None = None,
        origin: str | None = None,
    ) -> bool:
        """Only a summary revives a lost update: it lists what a live peer holds right now,
        where announcements and holder records may be older than an eviction."""
        fresh = {s for s in sources if s != self.self_id}
        if uid in self._settled or self._applied.has_applied(*uid):
            return False
        want = self._wants.get(uid)
        if want is None:
            given_up = uid in self._lost or uid in self.state_wants
            if given_up and not (revive and fresh):
                return False
            if not create and not given_up:
                return False
            if len(self._wants) >= self.config.max_wants:
                return False
            fresh_author = self.is_fresh(uid[0])
            if fresh_author and self._num_fresh_wants >= self.config.max_fresh_wants:
                self._note_deferred(uid)
                return False
            if uid in self._lost:
                del self._lost[uid]
                self.num_recovered += 1
            self.state_wants.discard(uid)
            author = uid[0]
            maybe = {author} if author != self.self_id else set()
            since = None if fresh | maybe else now
            self._wants[uid] = Want(
                header,
                fresh | maybe,
                since,
                named_by=named_by,
                fresh=fresh_author,
                wanted_at=now,
                origin=origin or "announced",
            )
            self._num_fresh_wants += fresh_author
            if named_by is not None:
                self._named_by[named_by] = self._named_by.get(named_by, 0) + 1
            return True
        want.sources |= fresh
        if header is not None and want.header is None:
            want.header = header
        return False

    def _named_applied(self, uid: UpdateId, now: float) -> None:
        """A live peer that serves state applied `uid` and does not hold it: a wanted one waits
        for a state once no peer offers it; a lost one does now (its state brings it)."""
        want = self._wants.get(uid)
        if want is not None:
            want.applied_named_at = now
        elif not self.state_wants.named(uid, now) and uid in self._lost:
            del self._lost[uid]
            self._await_state(uid, now)

    def _await_state(self, uid: UpdateId, named_at: float) -> None:
        """`uid` waits for a state (last named applied at `named_at`), reported to the caller."""
        self.state_wants.note(uid, named_at)
        self.newly_need_state.append(uid)

    def _remember_lost(self, uid: UpdateId) -> None:
        self._lost[uid] = None
        if len(self._lost) > self.config.max_lost:  # forget the oldest
            del self._lost[next(iter(self._lost))]

    def _note_deferred(self, uid: UpdateId) -> None:
        """A fresh update passed over (at max_fresh_wants or by its fetch cap), noted once however
        often it is heard (bench.attack sybil_learners counted 128,588 deferrals, mostly the same
        ids at max_fresh_wants heard again by push and by announcement lookups)."""
        if uid in self._deferred:
            return
        self._deferred[uid] = None
        if len(self._deferred) > self.config.max_deferred_remembered:
            del self._deferred[next(iter(self._deferred))]
        self.newly_deferred.append(uid)

    def _drop(self, uid: UpdateId) -> None:
        """No longer wanted: the share of the peer that named it is freed."""
        want = self._wants.pop(uid, None)
        if want is not None:
            self._num_fresh_wants -= want.fresh
        if want is not None and want.named_by is not None:
            left = self._named_by.get(want.named_by, 0) - 1
            if left > 0:
                self._named_by[want.named_by] = left
            else:
                self._named_by.pop(want.named_by, None)
