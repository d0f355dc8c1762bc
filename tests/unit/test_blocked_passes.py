"""bench.blocked_passes compares like with like: the blocked passes compute what the
whole-vector ones do (same bits for the adds, float tolerance for the reductions), and the
same bits run after run (fixed chunks, partials summed in a fixed order)."""

from __future__ import annotations

import torch

from bench.blocked_passes import blocked, whole


def vectors(n: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(3)
    return tuple(torch.randn(n, generator=gen) for _ in range(4))


def test_blocked_passes_match_the_whole_vector_ones() -> None:
    g, buf, acc, params = vectors(100_003)  # not a multiple of the chunk: a short last chunk
    acc_w, params_w, acc_b, params_b = acc.clone(), params.clone(), acc.clone(), params.clone()
    want = whole(g, buf, acc_w, params_w)
    got = blocked(1 << 15)(g, buf, acc_b, params_b)
    assert torch.equal(acc_b, acc_w) and torch.equal(params_b, params_w)
    assert not torch.equal(acc_b, acc)  # the step did move them
    for value, reference in zip(got, want, strict=True):
        assert abs(value - reference) <= 1e-4 * max(1.0, abs(reference))


def test_blocked_reductions_are_the_same_bits_every_run() -> None:
    g, buf, acc, params = vectors(70_000)
    runs = [blocked(1 << 15)(g, buf, acc.clone(), params.clone()) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
