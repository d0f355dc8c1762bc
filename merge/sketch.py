"""A short random-projection sketch of a replica, small enough for a heartbeat.

Two replicas that applied the same set of updates settle to the same parameters once their
outer momentum has played out (merge.outer.OuterOptimizer.rest_terms), whatever order they
applied them in; comparing sketches of that point measures how far they drifted apart without
shipping the replica. (The params themselves differ by the momentum tail of the last updates
applied in different orders: ~10 % of the params' norm on `tiny` at the default outer lr.)
The sketch projects a fixed random subsample of coordinates, so it estimates the relative
distance between two replicas up to sampling noise.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import NamedTuple

import torch

from merge.replica import Replica


class StateSketch(NamedTuple):
    as_is: list[float]
    """The params as they are."""
    settled: list[float]
    """Where they come to rest once the outer momentum has played out."""


class ReplicaSketch:
    """Same (numel, seed) on every node gives the same projection."""

    def __init__(self, numel: int, seed: str, *, dims: int = 32, samples: int = 16384) -> None:
        generator = torch.Generator().manual_seed(
            int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "little")
        )
        samples = min(samples, numel)
        self.dims = dims
        self._index = torch.randperm(numel, generator=generator)[:samples]
        self._projection = torch.randn(samples, dims, generator=generator, dtype=torch.float64)
        self._projection /= math.sqrt(dims)

    def __call__(self, params: torch.Tensor) -> list[float]:
        """The sketch of ``params`` as they are."""
        return self._project(params.detach().reshape(-1)[self._index].to(torch.float64))

    def of_state(self, replica: Replica, state: Mapping[str, object]) -> StateSketch:
        """Both sketches of ``state``, a state_dict of a replica like ``replica`` (a donor's,
        to be checked before it is loaded): ValueError if it is malformed."""
        params = state.get("params")
        settled = self.settled(replica, state)  # checks params' shape and dtype first
        assert isinstance(params, torch.Tensor)
        return StateSketch(as_is=self(params), settled=settled)

    def settled(self, replica: Replica, state: Mapping[str, object] | None = None) -> list[float]:
        """The sketch of where ``replica`` (or ``state``, a state_dict of a replica like it)
        comes to rest once its outer momentum has played out: what heartbeats carry, since it
        depends on the applied set alone, not on the order it was applied in."""
        return self._project(replica.settled_at(self._index, state))

    def _project(self, sample: torch.Tensor) -> list[float]:
        return [round(v, 7) for v in (sample @ self._projection).tolist()]


def relative_distance(a: list[float], b: list[float]) -> float | None:
    """||a - b|| / ||b||; None when the sketches cannot be compared."""
    if len(a) != len(b) or not a:
        return None
    diff = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b, strict=True)))
    norm = math.sqrt(sum(y * y for y in b))
    if not math.isfinite(diff) or norm == 0:
        return None
    return diff / norm
