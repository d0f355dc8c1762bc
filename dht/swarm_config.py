"""What a node joins the swarm with (SwarmConfig), the errors that say why it could not, and
the network's timing bounds; dht.network's SwarmNetwork runs on them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dht.reachability import RelayLimits
from dht.shards import ShardConfig

REQUEST_READ_TIMEOUT_S = 10.0
"""How long a stream's small request may take to arrive, and the longest a transfer may go
without a byte arriving (a stall)."""
MIN_LINK_BYTES_PER_S = 125_000.0
"""The slowest link (1 Mbit/s) a whole transfer's deadline is sized for; a stall is caught
sooner, by REQUEST_READ_TIMEOUT_S without a byte."""


class SwarmError(ValueError):
    """The swarm could not be joined; the message says why in one sentence."""


class RunMismatchError(SwarmError):
    """The swarm trains the same run id with another model or merge configuration."""

    theirs: object = None
    """The swarm's run summary (JSON), for the node to say which settings differ."""


@dataclass(frozen=True, kw_only=True)
class SwarmConfig:
    run_id: str
    fingerprint: str
    run_summary: dict[str, Any]
    """Model and merge settings, shown to a node whose configuration differs."""
    identity_path: str
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    use_relay: bool = True
    use_auto_relay: bool = False
    client_mode: bool = False
    serve_state: bool = True
    heartbeat_period_s: float = 5.0
    retain_updates: int = 16
    retain_bytes: int = 256 << 20
    """Retained updates held in memory; older ones spill to a per-node directory on disk."""
    spill_dir: str | None = None
    """Where that directory is created (default: the system's temporary directory)."""
    max_state_streams: int = 2
    """State downloads served at once; more are refused (the newcomer asks another donor)."""
    gap_wait_s: float = 30.0
    """How long an update that no live peer offers is waited for before it counts as lost."""
    max_update_bytes: int = 1 << 30
    max_state_bytes: int = 4 << 30
    relay_limits: RelayLimits = field(default_factory=RelayLimits)
    """What this node spends relaying for peers behind NAT."""
    bootstrap_peers: list[str] = field(default_factory=list)
    """The bootstrap peers as the user gave them (--peers); set from `initial_peers` when the
    config is built, and kept by `dataclasses.replace`, which the node uses to narrow
    `initial_peers` to the peers that answered (known peers of last run among them). They alone
    are the relays a node behind NAT reserves slots with: a known peer behind NAT among p2pd's
    static relays made autorelay wait its 3-minute boot delay for a candidate that never came,
    and a restarted home never got a relay slot (bench.chaos --topology nat)."""
    rejoin_peers: list[str] = field(default_factory=list)
    """A known member's peers: if none answers at start, the DHT starts alone and they are
    dialled in the background (dht.bootstrap_rejoin) instead of the node exiting."""
    shards: ShardConfig = field(default_factory=ShardConfig)
    """Sizes of the heartbeat shards (dht.shards, dht.heartbeat_shards)."""

    def __post_init__(self) -> None:
        if not self.bootstrap_peers:
            object.__setattr__(self, "bootstrap_peers", list(self.initial_peers))

    @property
    def prefix(self) -> str:
        return f"diloco/{self.fingerprint[:16]}"

    @property
    def retention_ttl_s(self) -> float:
        """Announcements outlive a few heartbeat periods but stay small: every subkey of an
        author's record travels through hivemind's DHT pipe on each get (HIVEMIND.md item 1)."""
        return max(60.0, 12 * self.heartbeat_period_s)
