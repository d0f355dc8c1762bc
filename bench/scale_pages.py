"""What `status` and the dashboard cost at N peers: one page against the whole swarm.

    python -m bench.scale_pages --peers 1000

N signed heartbeats (each listing 128 authors it merged, as a full heartbeat does past 128
peers) laid out in the shard tree real nodes build, in memory. It measures, side by side:
the keys the observer's walk reads; the time to build the dashboard's /api/swarm answer and
its size, paged (`--page-size`, the page's default) and whole (every peer, as before paging);
the same for `status --json`. The final line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from dashboard.view import PeerRecord, SwarmState, swarm_out
from dht.heartbeat import MAX_AUTHORS, Heartbeat
from dht.observer import PeerStatus, SwarmSnapshot
from dht.records import owner_subkey
from dht.shard_walk import SPLIT_VALUE, split_subkey, walk_tree
from dht.shards import ShardConfig, ShardTree
from merge.identity import Identity
from node.status import status_document

RUN = "bench"


def heartbeats(n: int) -> list[Heartbeat]:
    identities = [Identity.generate() for _ in range(n)]
    ids = [i.peer_id for i in identities]
    now = time.time()
    out = []
    for i, identity in enumerate(identities):
        beat = Heartbeat(
            peer_id=ids[i],
            org=f"org-{i % 8}",
            sent_at=now,
            round=100 + i % 5,
            loss=3.0 + (i % 100) / 100,
            val_loss=3.1 + (i % 100) / 100,
            updates_published=100,
            merged_by_author={ids[(i + k) % n]: 90 for k in range(1, min(n, MAX_AUTHORS + 1))},
            paths={"direct": 8, "holepunched": 0, "relayed": 0},
            rejected_peers={ids[0]: {"bad_signature": 1}} if i % 10 == 0 else {},
        )
        out.append(Heartbeat.verify(beat.sign(identity), ids[i]))
    return out


def median_s(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--page-size", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    beats = heartbeats(args.peers)

    tree = ShardTree(RUN, ShardConfig())
    for h in beats:
        tree.add(h.peer_id)
    dht: dict[str, dict[object, object]] = {}
    for leaf in tree.leaves():
        peers = sorted(tree.peers_in(leaf))
        dht.setdefault(leaf, {}).update({owner_subkey(p): b"beat" for p in peers})
        for depth in range(len(leaf)):
            dht.setdefault(leaf[:depth], {})[split_subkey(peers[0])] = SPLIT_VALUE
    walk = walk_tree(RUN, lambda p: dht.get(p, {}), max_keys=4096, max_depth=24)

    state = SwarmState(
        RUN, "f" * 64, "standalone", [PeerRecord(h, True, 1.0) for h in beats], time.time(),
        walk.leaves,
    )  # fmt: skip
    snapshot = SwarmSnapshot(RUN, "f" * 64, "{}", [PeerStatus(h, 1.0) for h in beats])
    page = (1, args.page_size)
    whole = (1, max(1, min(args.peers, 1000)))

    def api(size: int | None) -> str:
        return swarm_out(state, 1, size).model_dump_json()

    row = {
        "peers": args.peers,
        "page_size": args.page_size,
        "walk_keys": len(dht),
        "walk_leaves": len(walk.leaves),
        "walk_heartbeats": sum(walk.leaves.values()),
        "api_bytes_page": len(api(args.page_size)),
        "api_bytes_whole": len(api(None)),
        "api_ms_page": round(1e3 * median_s(lambda: api(args.page_size), args.repeats), 1),
        "api_ms_whole": round(1e3 * median_s(lambda: api(None), args.repeats), 1),
        "status_bytes_page": len(json.dumps(status_document(RUN, [snapshot], page))),
        "status_bytes_whole": len(json.dumps(status_document(RUN, [snapshot], whole))),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    print(
        f"{args.peers} peers: /api/swarm {row['api_bytes_page']:,} B paged vs "
        f"{row['api_bytes_whole']:,} B whole; {row['api_ms_page']} vs {row['api_ms_whole']} ms"
    )
    print(json.dumps({"rows": [row]}))


if __name__ == "__main__":
    main()
