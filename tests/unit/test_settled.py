"""Replicas that applied the same updates in different orders settle to the same point.

The consistency model lets replicas apply one set of updates in arrival order; the outer
momentum makes their params differ by its tail. Where they come to rest once the momentum
has played out depends on the set alone: what heartbeats sketch and drift compares.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.fragments import FragmentLayout
from merge.outer import DelayedNesterov, NesterovSGD, OuterOptimizer
from merge.replica import Replica

NUMEL = 64
SIZES = [10, 20, 4, 30]  # tensor sizes of a small model: 64 elements in all

update = st.tuples(
    st.integers(0, 2**31 - 1),  # seed of the pseudo-gradient
    st.floats(0.05, 2.0),  # weight
    st.integers(1, 8),  # learners the author counted
)


def optimizer(kind: str, numel: int) -> OuterOptimizer:
    if kind == "nesterov":
        return NesterovSGD(lr=0.7, momentum=0.9, numel=numel)
    return DelayedNesterov(lr=0.7, momentum=0.9, numel=numel)


def replica(kind: str, fragments: int) -> Replica:
    params = torch.linspace(-1, 1, NUMEL)
    if fragments == 1:
        return Replica(params, optimizer(kind, NUMEL))
    layout = FragmentLayout(SIZES, fragments)
    outers = [optimizer(kind, layout.fragment_numel(p)) for p in range(layout.num_fragments)]
    return Replica(params, outers, layout)


def apply(target: Replica, updates: list[tuple[int, float, int]]) -> None:
    for seed, weight, learners in updates:
        g = torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)) * 0.1
        if target.layout is None:
            target.outer.step(target.params, g, weight, learners)
            continue
        for p in range(target.layout.num_fragments):  # every fragment steps on its part
            part = target.layout.gather(target.params, p)
            target.outer_for(p).step(part, target.layout.gather(g, p), weight, learners)
            target.layout.scatter(target.params, p, part)


@settings(max_examples=60, deadline=None)
@given(
    updates=st.lists(update, min_size=1, max_size=24),
    data=st.data(),
    kind=st.sampled_from(["nesterov", "delayed_nesterov"]),
    fragments=st.sampled_from([1, 3]),
)
def test_the_settled_point_does_not_depend_on_the_order_updates_came_in(
    updates: list[tuple[int, float, int]], data: st.DataObject, kind: str, fragments: int
) -> None:
    reordered = data.draw(st.permutations(updates))
    one, other = replica(kind, fragments), replica(kind, fragments)
    apply(one, updates)
    apply(other, reordered)
    everything = torch.arange(NUMEL)
    settled = one.settled_at(everything)
    scale = max(float(settled.norm()), 1.0)
    assert float((settled - other.settled_at(everything)).norm()) <= 1e-5 * scale


def test_the_params_differ_by_the_tail_where_the_settled_point_does_not() -> None:
    updates = [(seed, 1.0, 2) for seed in range(10)]
    one, other = replica("nesterov", 1), replica("nesterov", 1)
    apply(one, updates)
    apply(other, updates[::-1])
    assert float((one.params - other.params).norm()) > 0.1 * float(one.params.norm())
    everything = torch.arange(NUMEL)
    assert torch.allclose(one.settled_at(everything), other.settled_at(everything), atol=1e-5)


@given(kind=st.sampled_from(["nesterov", "delayed_nesterov"]), fragments=st.sampled_from([1, 3]))
@settings(max_examples=10, deadline=None)
def test_a_state_dict_settles_where_its_replica_does(kind: str, fragments: int) -> None:
    live = replica(kind, fragments)
    apply(live, [(1, 1.0, 3), (2, 0.5, 3), (3, 1.0, 1)])
    index = torch.tensor([0, 5, 17, 40, 63])
    from_state = replica(kind, fragments).settled_at(index, live.state_dict())
    assert torch.equal(from_state, live.settled_at(index))


def test_a_replica_without_momentum_rests_where_it_is() -> None:
    fresh = replica("nesterov", 3)
    everything = torch.arange(NUMEL)
    assert torch.equal(fresh.settled_at(everything), fresh.params.double())


@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=10), data=st.data())
@settings(max_examples=50, deadline=None)
def test_locate_finds_each_flat_position_in_its_fragments_vector(
    sizes: list[int], data: st.DataObject
) -> None:
    layout = FragmentLayout(sizes, data.draw(st.integers(1, len(sizes))))
    flat = torch.randn(layout.numel)
    index = torch.arange(layout.numel)
    fragment, local = layout.locate(index)
    vectors = [layout.gather(flat, p) for p in range(layout.num_fragments)]
    found = torch.stack([vectors[int(f)][int(i)] for f, i in zip(fragment, local, strict=True)])
    assert torch.equal(found, flat)
