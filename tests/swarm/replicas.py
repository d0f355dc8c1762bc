"""What a swarm test compares between nodes after a run: the replica each one saved, and the
point it settles to.

Replicas that applied one set of updates in different orders hold params apart by their outer
momentum tail (DESIGN.md, consistency model), so comparing raw params fails whenever two
nodes merely received updates in another order; the settled point (merge.outer's rest terms)
depends on the applied set alone and is what drift and the heartbeats' sketches compare.
"""

from __future__ import annotations

from pathlib import Path

import torch

from merge.outer import OuterConfig, make_outer_optimizer
from node.checkpoint import read_checkpoint


def saved_replica(home: Path) -> dict:
    """The replica a node with ``home`` as its HOME saved last (a run's one checkpoint)."""
    (directory,) = {p.parent for p in (home / ".diloco").rglob("checkpoint.json")}
    state = read_checkpoint(directory)
    assert state is not None
    return state["replica"]


def settled_params(replica: dict, outer: OuterConfig | None = None) -> torch.Tensor:
    """Where ``replica``'s params come to rest once its outer momentum has played out with no
    further update (float64), for a run with the default outer optimizer unless ``outer``."""
    params = replica["params"]
    optimizer = make_outer_optimizer(outer or OuterConfig(), params.numel())
    settled = params.reshape(-1).to(torch.float64)
    for coefficient, buffer in optimizer.rest_terms(replica["outer"]):
        settled = settled + coefficient * buffer.to(torch.float64)
    return settled
