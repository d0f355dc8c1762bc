"""Identity files for group swarm tests: learner groups are peer-id prefixes (dht.grouping), so
a test that needs two known groups draws keys until each half of the id space has enough."""

from __future__ import annotations

from pathlib import Path

from dht.grouping import peer_bits
from merge.identity import Identity


def alternating_keys(folder: Path, run_id: str, count: int) -> list[Path]:
    """`count` identity files `node{i}.key` in `folder`, alternating between the two halves of
    run `run_id`'s id space: even nodes form group 0b0 at one bit, odd nodes group 0b1."""
    wanted = {"0": (count + 1) // 2, "1": count // 2}
    halves: dict[str, list[Identity]] = {"0": [], "1": []}
    while any(len(halves[bit]) < n for bit, n in wanted.items()):
        identity = Identity.generate()
        bit = peer_bits(run_id, identity.peer_id)[0]
        if len(halves[bit]) < wanted[bit]:
            halves[bit].append(identity)
    folder.mkdir(parents=True)
    paths = []
    for i in range(count):
        path = folder / f"node{i}.key"
        halves[str(i % 2)][i // 2].save(path)
        paths.append(path)
    return paths
