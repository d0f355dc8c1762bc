"""CatchUp's timings and bounds (dht.catchup): how long to wait, how often to ask, how much to
keep."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class CatchUpConfig:
    lost_after_s: float = 30.0
    """How long an update no live peer offers is waited for before it is counted lost."""
    retry_s: float = 2.0
    """How long after a failed fetch the same source may be asked again (if it claims it)."""
    author_retries: int = 6
    """Failed fetches in a row (not refusals) after which an update's author is no longer
    asked for it. Until then the author stays a source, asked again after retry_s, doubled
    after each failure up to max_retry_s: it holds its recent updates, and a fetch over a
    relayed connection that flaps fails now and then (tests/swarm/test_nat.py lost every update
    of a live home whose one failed fetch had dropped it as their only source)."""
    max_retry_s: float = 16.0
    """The longest wait before an author is asked again for an update after failures."""
    relay_patience_s: float = 8.0
    """How long an update whose best ready source is on a relayed connection waits,
    from when it became wanted, while a live peer on a direct connection does not offer it
    yet: behind NAT that peer is the public node, which fetches every home's update once and
    then serves it over its own link, where a fetch through the relay takes the home's thin
    uplink a second time (bench.chaos --topology nat, session 15: 27 of the cone home's 114
    MB went up twice, to the symmetric home and to the other cone home through the relay,
    while the public node's fetches from that uplink ran at 0.1 MB/s). A source with no
    connection yet (rank 2) does not wait: a dial may find it direct (a public swarm). 0:
    never waits."""
    stall_s: float = 0.0
    """A gap between two `declare_lost` polls longer than this is time this node did not run
    (its process stopped, its event loop blocked): every wait (an update no live peer offers,
    one a peer named applied, one waiting for a state) is moved on by the whole gap, so a
    node does not wake to count lost what it had no time to ask its peers about (session 26:
    a node stopped 12 s woke and counted its donor's updates 3-5 lost at once, 0.6 s before
    the donor's summary named them applied, so they waited for a state). 0: off (every gap
    counts). dht.gossip sets 3 heartbeat periods, the silence after which peers count a node
    gone; a node whose polls are always further apart declares nothing lost (it keeps
    wanting, within max_wants)."""
    mismatch_grace_s: float = 2.0
    """How long applied digests must differ before summaries are exchanged with that peer."""
    summary_period_s: float = 5.0
    """Least time between two summary exchanges with the same peer."""
    max_in_flight: int = 4
    """Fetches running at once."""
    max_summaries: int = 4
    """Summary exchanges started per poll (the others wait for a later poll): a thousand
    peers with other digests cost a few streams at a time, not a thousand."""
    max_wants: int = 1 << 14
    """Updates wanted at once; what peers announce beyond that is ignored until some are
    fetched or lost (a peer's summary can name a million ids: memory stays bounded)."""
    max_wants_per_peer: int = 4096
    """Updates wanted at once because one peer's summaries named them: one peer cannot fill
    the table (max_wants) that every other peer's repairs need room in."""
    max_fresh_wants: int = 512
    """Updates of fresh authors (no track record here) wanted at once: minutes of their fetch
    cap (dht.fetch_order). A flood announced faster than it is fetched cannot fill the table
    that established authors' updates need room in, and the table the pump walks on every
    announcement stays small. One over it is passed over (noted in `newly_deferred`) and
    learned again from a later announcement lookup or summary."""
    max_lost: int = 1 << 14
    """Lost updates remembered (the oldest forgotten first): a flood of ids no live peer
    holds cannot grow the table without bound. A forgotten one may be wanted (and counted
    lost) again if it is announced again."""
    max_deferred_remembered: int = 1 << 14
    """Fresh updates passed over that are remembered as counted (newly_deferred): one heard
    again (by push, by an announcement lookup, in a summary) is not counted again."""

    def __post_init__(self) -> None:
        for name in (
            "lost_after_s",
            "retry_s",
            "max_retry_s",
            "relay_patience_s",
            "stall_s",
            "mismatch_grace_s",
            "summary_period_s",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}.")
        for name in (
            "author_retries",
            "max_in_flight",
            "max_summaries",
            "max_wants",
            "max_wants_per_peer",
            "max_fresh_wants",
            "max_lost",
            "max_deferred_remembered",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}.")
