"""Node statistics behind one lock, and the layering between node/ and dashboard/."""

from __future__ import annotations

import subprocess
import sys
import threading

from dht.heartbeat import Heartbeat
from merge.identity import Identity
from node.stats import NodeStats, ReplicaView
from tests.conftest import REPO


def test_merges_counted_from_two_threads_are_all_kept() -> None:
    stats = NodeStats()

    def merge_many() -> None:
        for i in range(2000):
            stats.count_merge(i % 3)
            stats.record_replica(ReplicaView(f"d{i % 7}", (1.0, 0.0), i, ()))

    threads = [threading.Thread(target=merge_many) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = stats.snapshot()
    assert sum(snap.staleness_counts) == 4000
    assert snap.staleness_sum == 2 * sum(i % 3 for i in range(2000))


def test_drift_compares_only_replicas_with_an_applied_set_we_held() -> None:
    stats = NodeStats()
    a, b, z = "a" * 64, "b" * 64, "f" * 64
    stats.record_replica(ReplicaView(a, (1.0, 0.0), 1, ()))
    stats.record_replica(ReplicaView(b, (0.0, 2.0), 2, ()))
    p1, p2 = Identity.generate().peer_id, Identity.generate().peer_id
    same = Heartbeat(peer_id=p1, applied_digest=a, sketch=[1.1, 0.0])
    unknown = Heartbeat(peer_id=p2, applied_digest=z, sketch=[9.0, 9.0])
    assert stats.drift([unknown]) is None
    assert stats.drift([same, unknown]) == 0.1
    assert stats.snapshot().replica.num_applied == 2


def test_the_embedded_dashboard_does_not_import_the_node_runtime() -> None:
    code = (
        "import sys, dashboard.embedded; "
        "assert 'node.runtime' not in sys.modules, 'dashboard imports node.runtime'"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-800:]
