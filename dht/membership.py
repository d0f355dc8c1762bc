"""Membership: this node's signed heartbeats out, peers' heartbeats in, who is alive."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from dht.grouping_view import group_members
from dht.heartbeat import Heartbeat, HeartbeatError
from dht.heartbeat_shards import HeartbeatShards, ShardPoll
from dht.messages import RUN_LISTING_KEY
from dht.network import SwarmNetwork
from dht.records import subkey_owner
from dht.rejections import Rejections
from dht.shard_walk import covered
from dht.swarm_config import RunMismatchError
from merge.identity import Identity

logger = logging.getLogger(__name__)
MAX_FRESH_PEERS = 2
"""Live peers without an applied record here that an established node acts on at least (as
many as it has established peers if more: `established_view`); the others are counted apart
(`Membership.num_fresh_set_aside`)."""


@dataclass
class PeerView:
    heartbeat: Heartbeat
    last_seen: float
    first_seen: float
    gone: bool = False

    def alive(self, period_s: float, at: float | None = None) -> bool:
        """Seen within three periods of `at` (default: now)."""
        return (time.time() if at is None else at) - self.last_seen < 3 * period_s


class Membership:
    """Publishes this node's heartbeat and run record; reads and verifies everyone else's."""

    def __init__(
        self,
        network: SwarmNetwork,
        identity: Identity,
        *,
        heartbeat_fn: Callable[[], Heartbeat],
        reject: Rejections,
        on_event: Callable[..., None],
    ) -> None:
        self.network = network
        self.config = network.config
        self.identity = identity
        self.peer_id = identity.peer_id
        self.peers: dict[str, PeerView] = {}
        self._heartbeat_fn = heartbeat_fn
        self._reject = reject
        self._on_event = on_event
        self._bad_heartbeats = SeenSet(4096)
        self._dropped = DroppedPeers(4096)
        """The newest heartbeat of each peer whose view was dropped (a record it left behind
        revives nobody)."""
        self.shards = HeartbeatShards(network, self.peer_id)
        """Where this node's heartbeat goes and which shards it reads (dht.heartbeat_shards)."""
        self.admit: Callable[[str], bool] | None = None
        """Permissioned runs: whether a peer may take part (None: anyone may)."""
        self.org_of: Callable[[str], str | None] | None = None
        """Permissioned runs: a peer's organization from the allow list, not its own claim."""
        self.sent_heartbeats = 0
        """Heartbeats stored so far (a poll after the first must find this node's own)."""
        self.incomplete_polls = 0
        """Polls that missed this node's own heartbeat, so told nothing about absences."""
        self.has_record: Callable[[str], bool] | None = None
        """Whether this replica applied an update of a peer (dht.swarm: its last seq >= 1);
        None: every live peer is acted on."""
        self.num_fresh_set_aside = 0
        """Live peers without a record left out of `alive_peers` at its last call."""
        self.on_left: Callable[[str], None] | None = None
        """Called with a peer's id when it stops sending heartbeats (its state is released)."""
        self._legacy_only: set[str] = set()
        """Peers seen in the legacy key and in no shard: nodes of an earlier version."""
        self._missed: set[str] = set()
        """Peers a complete read of their own shard missed since their last newer heartbeat:
        reads of other shards no longer hold them alive, so they expire as a peer of this
        node's own shard does (`_hold_unread`)."""
        self.last_read_started: float | None = None
        """When the last read that returned had started (None: none returned yet)."""
        self._known_at: float | None = None
        """When the last read returned: the time liveness is judged at (`judged_at`)."""

    def judged_at(self) -> float:
        """The time liveness is judged at: when the last read returned (now before any).

        A peer's absence is proven only by a read that returned without it: between reads,
        and while one is in flight, nothing newer is known, so the clock stops at the last
        read. Judged by the wall clock, a node whose own loop stalled past three periods
        (2 cores, 16 nodes: session 18's views flapped in bursts of up to 14 peers at once)
        or whose read of a record full of ~1,000 Sybil heartbeats took seconds saw every
        honest peer as silent, and then sized its updates and chose its push targets and
        reducers as if they had left."""
        return time.time() if self._known_at is None else self._known_at

    def alive_peers(self) -> list[Heartbeat]:
        """The live peers this node acts on (pushes to, compares notes with, counts): every
        peer with an applied record here and at most MAX_FRESH_PEERS without one
        (`established_view`); `is_alive` still answers for every live peer."""
        period, at = self.config.heartbeat_period_s, self.judged_at()
        alive = [v for v in list(self.peers.values()) if v.alive(period, at)]
        if self.has_record is None or len(alive) <= MAX_FRESH_PEERS:  # none to set aside
            self.num_fresh_set_aside = 0
            return [v.heartbeat for v in alive]
        kept = established_view(alive, self.has_record, MAX_FRESH_PEERS)
        self.num_fresh_set_aside = len(alive) - len(kept)
        return [v.heartbeat for v in kept]

    def group_peers(self, prefix: str) -> list[str]:
        """The live members of the learner group `prefix`, this node included when it is one
        (sorted). Complete once `shards.group_prefix` is this node's group: each poll then
        reads the group's shard keys (dht.grouping_view); not used by training yet."""
        alive = [h.peer_id for h in self.alive_peers()] + [self.peer_id]
        return group_members(self.config.run_id, prefix, alive)

    def is_alive(self, peer_id: str) -> bool:
        view = self.peers.get(peer_id)
        return view is not None and view.alive(self.config.heartbeat_period_s, self.judged_at())

    def heard_from(self, peer_id: str) -> None:
        """A live peer opened a stream to this node or answered one (dht.network_streams):
        it is alive now, whatever its heartbeats' lag. A DHT store on a loaded machine takes
        seconds (session 19's 16 nodes on 2 cores: 258 heartbeat gaps over two periods, in
        316 of 418 views that dropped a peer), and group members talk exactly while a round
        needs them in each other's views. Revives no peer already gone and adds none: only a
        signed heartbeat does that."""
        view = self.peers.get(peer_id)
        if view is not None and not view.gone:
            view.last_seen = max(view.last_seen, time.time())

    async def check_run(self) -> None:
        """A node whose run id is trained with another configuration is told so, clearly."""
        records = await self.network.dht_get(f"diloco-run/{self.config.run_id}")
        others = {fp: summary for fp, summary in records.items() if fp != self.config.fingerprint}
        if others and self.config.fingerprint not in records:
            fingerprint, summary = next(iter(others.items()))
            error = RunMismatchError(
                f"run '{self.config.run_id}' in this swarm uses a different model or run "
                f"configuration (fingerprint {str(fingerprint)[:12]}: {summary}) than this node "
                f"(fingerprint {self.config.fingerprint[:12]}: {self.config.run_summary}); "
                "join with the same settings or choose another --run-id"
            )
            error.theirs = summary
            raise error

    async def send_heartbeat(self) -> None:
        heartbeat = self._heartbeat_fn()
        ttl = 3 * self.config.heartbeat_period_s
        # An owner subkey: only this node's key can write it (dht.records.OwnerValidator),
        # under this node's heartbeat shard (dht.heartbeat_shards).
        run_record_due = await self.shards.store(
            heartbeat.sign(self.identity), ttl, run_record=not self.sent_heartbeats
        )
        if run_record_due:  # one record for the whole swarm: a few peers refresh it
            await self.network.dht_store(
                f"diloco-run/{self.config.run_id}",
                self.config.fingerprint,
                json.dumps(self.config.run_summary, sort_keys=True),
                ttl,
            )
            await self.network.dht_store(RUN_LISTING_KEY, self.config.run_id, True, ttl)
        self.sent_heartbeats += 1

    async def poll(self) -> list[Heartbeat]:
        """Read this node's heartbeat shard (and, when due, a sample of the others and the
        legacy key); the verified heartbeats, newest view of each peer updated."""
        started = time.time()
        read = await self.shards.read(
            sent=self.sent_heartbeats > 0, ttl_s=3 * self.config.heartbeat_period_s
        )
        self.last_read_started = max(started, self.last_read_started or started)
        # Who was alive is judged when the last read returned, what this one proves at its
        # return: a loop that stalled between the two makes nobody silent.
        before, now = self.judged_at(), time.time()
        seen: list[Heartbeat] = []
        for subkey, blob in read.records.items():
            heartbeat = self._parse(subkey, blob)
            if heartbeat is not None:
                self._see_peer(heartbeat, before, now)
                seen.append(heartbeat)
        if read.moved:
            await self.send_heartbeat()  # into the leaf this node has just moved to
        elif not read.own_found:
            self._hold_peers(before, now)
        self._hold_unread(read, {h.peer_id for h in seen}, before, now)
        self._forget_dead_peers(now)
        self._known_at = max(now, self._known_at or now)
        self.network.sync_dht_refusals()  # records the DHT refused: forged, overwritten, junk
        return seen

    def _hold_unread(self, read: ShardPoll, seen: set[str], before: float, now: float) -> None:
        """A peer's absence is proven only by a read of the shard that holds it (or of the
        legacy key, for a peer seen only there): peers elsewhere in a large swarm, seen in an
        earlier sample, stay alive until a complete read of their shard misses them; from
        then on reads of other shards hold them no more (until a newer heartbeat of theirs is
        read), so they expire as a peer of this node's own shard does. Before, every later
        read that did not cover their shard held them again: a dead peer in another shard
        stayed alive until a run of samples covered its shard for three periods."""
        period = self.config.heartbeat_period_s
        for peer_id, view in self.peers.items():
            if peer_id in seen or not view.alive(period, before):
                continue
            if peer_id in self._legacy_only:
                proven = read.legacy_read
            else:
                proven = covered(self.shards.position(peer_id), read.leaves)
            if proven and read.own_found:  # missed where it would be: held no more
                self._missed.add(peer_id)
            elif not proven and peer_id not in self._missed:
                view.last_seen = max(view.last_seen, now - period)
        legacy_only = (self._legacy_only | read.legacy_peers) - read.shard_peers
        self._legacy_only = legacy_only & set(self.peers)
        self._missed &= set(self.peers)

    def _hold_peers(self, before: float, now: float) -> None:
        """A read without this node's own live heartbeat was incomplete (timed out, or the
        record too large to read whole, as ~1,000 Sybil heartbeats make it): its absences
        prove nothing, so the peers alive before it stay alive. Otherwise a flood of valid
        heartbeats from fresh keys would make honest nodes drop each other, and each would
        then size its updates as a lone learner."""
        self.incomplete_polls += 1
        period = self.config.heartbeat_period_s
        for view in self.peers.values():
            if view.alive(period, before):
                view.last_seen = max(view.last_seen, now - period)

    def _parse(self, subkey: object, blob: object) -> Heartbeat | None:
        """The verified heartbeat of the peer owning `subkey`; each bad record counted once."""
        peer_id = subkey_owner(subkey)
        if peer_id == self.peer_id:
            return None
        try:
            if peer_id is None:
                raise HeartbeatError("malformed", "a heartbeat record's subkey names no owner")
            if self.admit is not None and not self.admit(peer_id):
                raise HeartbeatError("not_allowed", "the peer is not in the allow list")
            heartbeat = Heartbeat.verify(blob, peer_id)
        except HeartbeatError as exc:
            if self._bad_heartbeats.add(
                hash((str(subkey), blob if isinstance(blob, bytes) else 0))
            ):
                reason = "not_allowed" if exc.reason == "not_allowed" else f"heartbeat_{exc.reason}"
                self._reject(reason, peer_id or str(subkey)[:128], str(exc), update=False)
            return None
        org = self.org_of(heartbeat.peer_id) if self.org_of is not None else None
        return heartbeat if org is None else dataclasses.replace(heartbeat, org=org)

    def _see_peer(self, heartbeat: Heartbeat, before: float, now: float) -> None:
        """Only a newer heartbeat refreshes a peer: a replayed record keeps nobody alive. A
        peer not alive when the last read returned (`before`) joins again."""
        view = self.peers.get(heartbeat.peer_id)
        if view is None or not view.alive(self.config.heartbeat_period_s, before):
            if view is not None and heartbeat.sent_at <= view.heartbeat.sent_at:
                return  # the record a dead peer left behind
            if view is None and self._dropped.left_behind(heartbeat.peer_id, heartbeat.sent_at):
                return  # the same, once the dead peer's view was dropped
            self._on_event("peer_joined", peer_id=heartbeat.peer_id, org=heartbeat.org)
            self.peers[heartbeat.peer_id] = PeerView(heartbeat, now, now)
            self._missed.discard(heartbeat.peer_id)
        elif heartbeat.sent_at > view.heartbeat.sent_at:
            view.heartbeat, view.last_seen = heartbeat, max(view.last_seen, now)
            self._missed.discard(heartbeat.peer_id)

    def _forget_dead_peers(self, now: float) -> None:
        """Peers silent for three periods before `now` (when the read that missed them
        returned) left; their views are dropped once their last heartbeat record has expired
        from the DHT too (so it cannot revive them)."""
        for peer_id, view in list(self.peers.items()):
            if not view.alive(self.config.heartbeat_period_s, now) and not view.gone:
                view.gone = True
                self._on_event("peer_left", peer_id=peer_id, last_seen=round(view.last_seen, 3))
                if self.on_left is not None:
                    self.on_left(peer_id)
            if view.gone and now - view.last_seen > self.forget_after_s:
                self._dropped.drop(peer_id, view.heartbeat.sent_at)
                del self.peers[peer_id]

    @property
    def forget_after_s(self) -> float:
        """Longer than a heartbeat record lives in the DHT (3 periods), with a margin."""
        return 20 * self.config.heartbeat_period_s


def established_view(
    alive: list[PeerView], has_record: Callable[[str], bool], max_fresh: int
) -> list[PeerView]:
    """`alive` (in its order) less the fresh peers after the first seen `max_fresh` (or as
    many as there are established peers, if more).

    A fresh peer has no applied update here and is in no learner group (a group member
    publishes under its group's key). Keys cost nothing: in bench.attack's sybil_vouchers, 8
    Sybil heartbeats beside the poisoner and its accomplice made each honest node push every
    header to 8 hostless keys and compare notes with 3 of them every 2 s (each a failed dial),
    and its loss over the last 20 rounds was 4-6 % above the clean runs' in 5 runs of 5 (1.00x
    with the accomplice alone; 0.99-1.01x with this bound: docs/bench-attack.md, flood11). A
    node that holds no record of any live peer (a newcomer, or one whose every established
    peer left) acts on all of them: it has nothing to tell a stranger from a peer by. Every
    replica decides from what it applied."""
    established = {v.heartbeat.peer_id for v in alive if is_established(v, has_record)}
    if not established:
        return list(alive)
    fresh = sorted(
        (v for v in alive if v.heartbeat.peer_id not in established),
        key=lambda v: (v.first_seen, v.heartbeat.peer_id),
    )
    # As many fresh keys as established peers, at least `max_fresh`: a swarm whose nodes all
    # start at once (every peer fresh to every other) still pushes to most of them.
    kept = established | {v.heartbeat.peer_id for v in fresh[: max(max_fresh, len(established))]}
    return [v for v in alive if v.heartbeat.peer_id in kept]


def is_established(view: PeerView, has_record: Callable[[str], bool]) -> bool:
    return view.heartbeat.group_bits is not None or has_record(view.heartbeat.peer_id)


class DroppedPeers:
    """Per peer whose view membership dropped, the `sent_at` of its newest heartbeat seen.

    A view is dropped 20 periods after the peer fell silent, but its last heartbeat record
    lives in the DHT as long as its writer asked: three periods for a node, 60 s for the
    Sybil vouchers of bench.attack, which then "joined" for three periods and "left" every
    ~20 s until the record expired (33-37 joins per honest node and run against 2 clean, each
    one a live peer again to push to and compare notes with). A record no newer than the one
    seen before the drop is that record again: it revives nobody. A later heartbeat is the
    peer back. Bounded (the oldest peers go first): a flood of keys costs memory once."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}.")
        self._sent_at: OrderedDict[str, float] = OrderedDict()
        self._capacity = capacity

    def drop(self, peer_id: str, sent_at: float) -> None:
        self._sent_at[peer_id] = max(sent_at, self._sent_at.pop(peer_id, sent_at))
        if len(self._sent_at) > self._capacity:
            self._sent_at.popitem(last=False)

    def left_behind(self, peer_id: str, sent_at: float) -> bool:
        """Whether a heartbeat sent at `sent_at` is no newer than the dropped view's (a peer
        seen again with a newer one is forgotten here: it is back)."""
        last = self._sent_at.get(peer_id)
        if last is None:
            return False
        if sent_at <= last:
            return True
        del self._sent_at[peer_id]
        return False

    def __len__(self) -> int:
        return len(self._sent_at)


class SeenSet:
    """A bounded set: counts each bad record once instead of on every poll."""

    def __init__(self, capacity: int) -> None:
        self._items: OrderedDict[int, None] = OrderedDict()
        self._capacity = capacity

    def add(self, item: int) -> bool:
        """True when `item` is new."""
        if item in self._items:
            return False
        self._items[item] = None
        if len(self._items) > self._capacity:
            self._items.popitem(last=False)
        return True
