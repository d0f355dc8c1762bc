"""What dht.catchup's CatchUp hands out and keeps per wanted update: a `Fetch` to start,
what one peer's summary did (`Learned`), and the bookkeeping of one wanted update (`Want`).
Split from dht/catchup.py (session 23), moved verbatim but for `Fetch.cause` and
`Want.origin`."""

from __future__ import annotations

from dataclasses import dataclass, field

from dht.ranges import UpdateId


@dataclass(frozen=True)
class Fetch:
    author: str
    seq: int
    peer_id: str
    cause: str = field(default="catchup", compare=False)
    """Why this node wanted it (its want's origin: `Want.origin`), for update_fetched."""

    @property
    def update_id(self) -> UpdateId:
        return (self.author, self.seq)


@dataclass
class Want:
    header: object | None
    sources: set[str]
    sourceless_since: float | None
    failed_at: dict[str, float] = field(default_factory=dict)
    author_failures: int = 0
    """Fetches from the author that failed in a row (its retry waits double with each)."""
    in_flight: str | None = None
    named_by: str | None = None
    """The peer whose summary made this update wanted (its max_wants_per_peer share)."""
    deferred: bool = False
    """Passed over at least once by the fresh authors' fetch cap (dht.fetch_order)."""
    fresh: bool = False
    """Its author was fresh when it became wanted (counted in max_fresh_wants)."""
    wanted_at: float = 0.0
    """When it became wanted (relay_patience_s counts from here)."""
    applied_named_at: float | None = None
    """When a live peer that serves state last named it applied without holding it."""
    origin: str = "announced"
    """How it became wanted, for the update_fetched event's `cause`: "announced" (a header
    pushed or looked up), "summary" (a peer's summary: repair), or the cause a caller named
    (`announced(cause=...)`: a group update handed over by the shard fetch, say)."""


@dataclass(frozen=True)
class Learned:
    """What one peer's summary did."""

    num_new: int
    """Updates newly wanted."""
    num_capped: int
    """Updates not wanted because the peer's share of wants (max_wants_per_peer) was full."""
    num_unreachable: int = 0
    """Updates the peer applied that this node declared lost or waits a state for and the peer
    does not hold: no fetch can bring them, only the peer's state (dht.realign's gap)."""
