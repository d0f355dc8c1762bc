"""A short random-projection sketch of a replica, small enough for a heartbeat.

Two replicas that applied the same set of updates should hold (almost) the same parameters;
comparing their sketches measures how far they drifted apart without shipping the replica.
The sketch projects a fixed random subsample of coordinates, so it estimates the relative
distance between two replicas up to sampling noise.
"""

from __future__ import annotations

import hashlib
import math

import torch


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
        sample = params.detach().reshape(-1)[self._index].to(torch.float64)
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
