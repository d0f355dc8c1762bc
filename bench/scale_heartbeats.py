"""DHT records one node reads per second for membership, with real DHTs on loopback.

    python -m bench.scale_heartbeats --nodes 6 --seconds 40               # this tree
    python -m bench.scale_heartbeats --nodes 6 --seconds 40 --max-records 2   # forced shards
    python -m bench.scale_heartbeats --nodes 6 --seconds 10 --max-records 2 --observe

N members (each a real p2pd and hivemind DHT process, with this tree's dht.membership) send
heartbeats every --period seconds and poll membership as a node's swarm does (every
min(1, period / 2) s). Every `dht_get` a member makes is counted: keys read and the records
(subkeys) they returned, per node per second. It runs whichever dht/ is first on the path:
copied out of the tree (`cp bench/scale_heartbeats.py /tmp/`) and run with
PYTHONPATH=<an older checkout> it measures the single-key membership before sharding.
--observe: at the end, `status`'s observer (`dht.observer.SwarmObserver`, a client DHT
joined through the first member) walks the shard tree from its root and reports how many of
the N members it found and in which shards. The final line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from dht.heartbeat import Heartbeat
from dht.membership import Membership
from dht.network import SwarmNetwork
from dht.rejections import Rejections
from dht.swarm_config import SwarmConfig
from merge.identity import Identity


class CountingNetwork(SwarmNetwork):
    """A node's real network that counts what its DHT reads return."""

    keys_read = 0
    records_read = 0

    async def dht_get(self, key: str) -> dict[Any, Any]:
        found = await super().dht_get(key)
        self.keys_read += 1
        self.records_read += len(found)
        return found


def start_member(config: SwarmConfig, identity: Identity) -> tuple[CountingNetwork, Membership]:
    network = CountingNetwork(config, identity, Rejections(lambda result: None))
    network.start(60.0)
    membership = Membership(
        network,
        identity,
        heartbeat_fn=lambda: Heartbeat(
            peer_id=identity.peer_id,
            sent_at=time.time(),
            heartbeat_period_s=config.heartbeat_period_s,
        ),
        reject=Rejections(lambda result: None),
        on_event=lambda *a, **k: None,
    )
    network.call(membership.send_heartbeat(), 60.0)
    return network, membership


async def schedule(network: SwarmNetwork, membership: Membership, period_s: float) -> None:
    """Heartbeats and polls on the member's loop, at a node's swarm's periods."""

    async def poll() -> None:
        await membership.poll()

    network.every(period_s, membership.send_heartbeat)
    network.every(min(1.0, period_s / 2), poll)


def observe(network: SwarmNetwork) -> dict[str, Any]:
    """What `status` sees of the members: the peers its walk of the shard tree found."""
    from dht.observer import SwarmObserver

    with SwarmObserver(network.read_visible_maddrs()[:1]) as observer:
        snapshots = observer.snapshot("bench-heartbeats")
    peers = {p.heartbeat.peer_id for snap in snapshots for p in snap.peers}
    shards = {k: v for snap in snapshots for k, v in snap.shards.items()}
    return {"observer_peers": len(peers), "observer_shards": shards}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=40.0, help="measured time")
    parser.add_argument("--period", type=float, default=1.0, help="heartbeat period (s)")
    parser.add_argument("--max-records", type=int, help="heartbeats per shard (default: 32)")
    parser.add_argument("--observe", action="store_true", help="walk the tree as status does")
    args = parser.parse_args()
    extra: dict[str, Any] = {}
    if args.max_records is not None:
        from dht.shards import ShardConfig

        extra["shards"] = ShardConfig(max_records=args.max_records)
    members: list[tuple[CountingNetwork, Membership]] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for i in range(args.nodes):
                peers = members[0][0].read_visible_maddrs()[:1] if members else []
                config = SwarmConfig(
                    run_id="bench-heartbeats", fingerprint="b" * 64, run_summary={},
                    identity_path=str(Path(tmp) / f"id{i}"), initial_peers=peers,
                    heartbeat_period_s=args.period, **extra,
                )  # fmt: skip
                identity = Identity.generate()
                identity.save(config.identity_path)  # p2pd's key: this Ed25519 identity
                members.append(start_member(config, identity))
            for network, membership in members:
                network.call(schedule(network, membership, args.period), 10.0)
            time.sleep(3 * args.period)  # every member has walked to its shard
            before = [(n.keys_read, n.records_read) for n, _ in members]
            started = time.time()
            time.sleep(args.seconds)
            elapsed = time.time() - started
            after = [(n.keys_read, n.records_read) for n, _ in members]
            seen = [len(m.alive_peers()) for _, m in members]
            depths = [m.shards.cursor.depth for _, m in members if hasattr(m, "shards")]
            observed = observe(members[0][0]) if args.observe else {}
        finally:
            for network, _ in members:
                network.shutdown()
    keys = [(a[0] - b[0]) / elapsed for a, b in zip(after, before, strict=True)]
    records = [(a[1] - b[1]) / elapsed for a, b in zip(after, before, strict=True)]
    row = {
        "nodes": args.nodes,
        "max_records": args.max_records,
        "seconds": round(elapsed, 1),
        "keys_read_per_node_per_s": round(statistics.mean(keys), 2),
        "records_read_per_node_per_s": round(statistics.mean(records), 2),
        "max_records_read_per_node_per_s": round(max(records), 2),
        "alive_peers_seen": seen,
        "shard_depths": depths,
        **observed,
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
