"""A fake swarm for the catch-up logic: nodes, a transport with scheduled faults, a clock.

No network and no sleeping: time is a number that the simulation advances. Faults are
scheduled by (author, seq) and by node: a push dropped, delivered late or twice, an author
dying, a partition between two groups that heals at a given time.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from dht.catchup import CatchUp, CatchUpConfig
from dht.ranges import UpdateId, to_ranges

CONFIG = CatchUpConfig(lost_after_s=10.0, retry_s=1.0, mismatch_grace_s=1.0, summary_period_s=2.0)
STEP_S = 0.5


@dataclass
class SimNode:
    peer_id: str
    applied: set[UpdateId] = field(default_factory=set)
    retained: set[UpdateId] = field(default_factory=set)
    alive: bool = True
    catchup: CatchUp = field(init=False)

    def __post_init__(self) -> None:
        self.catchup = CatchUp(CONFIG, self.peer_id, self)

    def has_applied(self, author: str, seq: int) -> bool:
        return (author, seq) in self.applied

    def digest(self) -> str:
        lines = sorted(f"{a}:{s}\n" for a, s in self.applied)
        return hashlib.sha256("".join(lines).encode()).hexdigest()

    def summary(self) -> tuple[dict, dict]:
        return _ranges(self.applied), _ranges(self.retained)


def _ranges(ids: set[UpdateId]) -> dict:
    by_author: dict[str, list[int]] = {}
    for author, seq in ids:
        by_author.setdefault(author, []).append(seq)
    return to_ranges(by_author)


@dataclass
class Schedule:
    """Faults, each keyed by what it hits."""

    deliveries: dict[tuple[str, UpdateId], list[float]] = field(default_factory=dict)
    """(receiver, update) -> times its push arrives; [] drops it, two times duplicate it.
    Unlisted pushes arrive one step after publishing."""
    deaths: dict[str, float] = field(default_factory=dict)
    """peer -> when it dies (its retained updates go with it)."""
    partition: tuple[set[str], float, float] | None = None
    """(one side, from, until): no traffic crosses between that side and the rest meanwhile."""
    retain_limit: int | None = None
    """Updates of each author a node keeps to serve (lowest seqs evicted first); None: all."""


class SimSwarm:
    def __init__(self, peer_ids: list[str], schedule: Schedule | None = None) -> None:
        self.nodes = {p: SimNode(p) for p in peer_ids}
        self.schedule = schedule or Schedule()
        self.now = 0.0
        self.pushes: list[tuple[float, str, UpdateId]] = []
        self.lost_events: list[tuple[str, UpdateId]] = []
        self.num_fetches = 0

    # ---- what happens ---------------------------------------------------------------------------

    def publish(self, author: str, seq: int) -> None:
        node, uid = self.nodes[author], (author, seq)
        node.applied.add(uid)
        self._retain(node, uid)
        for receiver in self.nodes:
            if receiver == author:
                continue
            times = self.schedule.deliveries.get((receiver, uid), [self.now + STEP_S])
            self.pushes.extend((t, receiver, uid) for t in times)

    def run(self, until_s: float) -> None:
        while self.now < until_s:
            self.step()

    def step(self) -> None:
        self.now += STEP_S
        for peer_id, at in self.schedule.deaths.items():
            if at <= self.now:
                self.nodes[peer_id].alive = False
        self._deliver_pushes()
        for node in self.live():
            self._act(node)

    def live(self) -> list[SimNode]:
        return [n for n in self.nodes.values() if n.alive]

    def applied_sets(self) -> list[set[UpdateId]]:
        return [n.applied for n in self.live()]

    # ---- the fake transport ---------------------------------------------------------------------

    def reachable(self, a: str, b: str) -> bool:
        if not (self.nodes[a].alive and self.nodes[b].alive):
            return False
        if self.schedule.partition is not None:
            side, start, end = self.schedule.partition
            if start <= self.now < end and ((a in side) != (b in side)):
                return False
        return True

    def _deliver_pushes(self) -> None:
        due = [p for p in self.pushes if p[0] <= self.now]
        self.pushes = [p for p in self.pushes if p[0] > self.now]
        for _, receiver, uid in due:
            if self.reachable(uid[0], receiver):
                self.nodes[receiver].catchup.announced(uid[0], uid[1], None, self.now)

    def _act(self, node: SimNode) -> None:
        visible = {p for p in self.nodes if p != node.peer_id and self.reachable(node.peer_id, p)}
        for uid in node.catchup.declare_lost(self.now, visible):
            self.lost_events.append((node.peer_id, uid))
        digests = {p: self.nodes[p].digest() for p in visible}
        for peer_id in node.catchup.summary_peers(self.now, node.digest(), digests):
            self._exchange_summaries(node, self.nodes[peer_id])
        for fetch in node.catchup.next_fetches(self.now, visible):
            self._fetch(node, fetch.update_id, fetch.peer_id)

    def _exchange_summaries(self, asker: SimNode, peer: SimNode) -> None:
        peer.catchup.summary(asker.peer_id, *asker.summary(), self.now)
        asker.catchup.summary(peer.peer_id, *peer.summary(), self.now)

    def _fetch(self, node: SimNode, uid: UpdateId, source: str) -> None:
        self.num_fetches += 1
        holder = self.nodes[source]
        if not self.reachable(node.peer_id, source):
            node.catchup.failed(uid, source, self.now)
            return
        if uid not in holder.retained:  # the real server's answer: "not held"
            node.catchup.failed(uid, source, self.now, refused=True)
            return
        node.applied.add(uid)  # applied at most once: a set
        self._retain(node, uid)
        node.catchup.fetched(uid)

    def _retain(self, node: SimNode, uid: UpdateId) -> None:
        node.retained.add(uid)
        limit = self.schedule.retain_limit
        if limit is not None:
            same_author = sorted(u for u in node.retained if u[0] == uid[0])
            node.retained -= set(same_author[:-limit])
