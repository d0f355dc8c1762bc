"""The two paths of tests/unit/test_shard_round.py and the tests beside it: pipelines on one
start, one-member group updates of a `Spec`, a round applied by parts (`_by_shards`: part Gram
matrices, the plan, the members' weighted sums) or one by one (`_one_by_one`), and the check
that two pipelines ended alike (`_assert_alike`). Moved out of test_shard_round.py unchanged in
session 25."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from dht.grouping import group_key
from merge.group_chunks import aligned_bounds
from merge.group_update import ContributionHeader, GroupReduction, GroupUpdate, RoundFields
from merge.identity import Identity
from merge.outer import OuterConfig, OuterKind, make_outer_optimizer
from merge.pipeline import MergeConfig, UpdatePipeline
from merge.replica import Replica
from merge.shard_round import (
    CapUndecided,
    Incoming,
    RoundPlan,
    ShardRound,
    part_gram,
    state_tensors,
    summed_gram,
)
from merge.weighting import StalenessConfig, TokenWeightConfig
from tests.factories import FINGERPRINT

RUN = "run-shard-round"
NUMEL = 30
IDS = [Identity.generate() for _ in range(6)]
DIRECTION = torch.linspace(-1.0, 1.0, NUMEL) / torch.linspace(-1.0, 1.0, NUMEL).norm()


def _everyone(peer: str) -> bool:
    return True


def _pipeline(kind: OuterKind) -> UpdatePipeline:
    config = MergeConfig(
        outer=OuterConfig(kind=kind, lr=0.7, momentum=0.9),
        staleness=StalenessConfig(kind="polynomial", a=0.5),
        token_weight=TokenWeightConfig(reference_tokens=1000),
        max_inner_steps=100,
        max_tokens_per_step=100,
    )
    start = torch.linspace(1.0, 2.0, NUMEL)
    replica = Replica(start, make_outer_optimizer(config.outer, NUMEL))
    pipeline = UpdatePipeline(replica, config, FINGERPRINT)
    pipeline.run_id = RUN
    return pipeline


@dataclass(frozen=True)
class Spec:
    group: int
    round: int
    kind: str
    """honest, big (an off-center size), outlier, huge (over the params norm cap), against."""
    variant: int
    staleness: int
    low: bool = False
    """Its group claims one learner whatever the others claim (sized by the learner floor)."""


def _tensor(spec: Spec, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1000 + spec.group * 50 + spec.round * 5)
    noise = torch.randn(NUMEL, generator=generator) / NUMEL**0.5
    honest = 0.3 * (DIRECTION + 0.5 * noise + 0.01 * spec.variant)
    size = {"honest": 1.0, "big": 3.0, "outlier": 10.0, "huge": 100.0, "against": -1.5}
    return (honest if spec.kind != "against" else 0.3 * DIRECTION) * size[spec.kind]


def _update(spec: Spec, seed: int, learners: int) -> GroupUpdate:
    """A one-member group's update of `spec` (its aggregate: the member's part), claiming
    `learners` (one if `spec.low`)."""
    member = IDS[spec.group]
    key = group_key(format(spec.group, "b"))
    reduction = GroupReduction(group_key=key, epoch=0, round=spec.round, members=[member.peer_id])
    fields = RoundFields(
        run_id=RUN, group_key=key, epoch=0, round=spec.round, learners=1 if spec.low else learners,
        base_applied=10, published_applied=10 + spec.staleness,
    )  # fmt: skip
    tensor = _tensor(spec, seed)
    reduction.contribute(ContributionHeader.of(tensor, member, fields, 500), tensor)
    reduction.close()
    reduction.cosign(member.peer_id, member.sign(reduction.statement(member.peer_id)))
    assert isinstance(reduction.outcome, GroupUpdate)
    return reduction.outcome


def _ordered(
    pipeline: UpdatePipeline, updates: Sequence[GroupUpdate]
) -> tuple[ShardRound, list[Incoming]]:
    """The round's merge for `pipeline` and `updates` as it orders them (ids in order)."""
    rounds = ShardRound(pipeline.groups)
    return rounds, rounds.order([Incoming.of(pipeline.groups, u, _everyone) for u in updates])


def _shards(incoming: Sequence[Incoming], start: int, end: int) -> list[torch.Tensor]:
    """One member's slice of each update (zeros for one refused before its tensor is read:
    in the shard path its shards are not fetched)."""
    out = []
    for inc in incoming:
        update = inc.update
        ok = inc.problem is None and update is not None and update.aggregate.numel() == NUMEL
        out.append(update.aggregate[start:end] if ok and update else torch.zeros(end - start))
    return out


def _grams(
    pipeline: UpdatePipeline, incoming: Sequence[Incoming], members: int
) -> list[list[list[float]]]:
    states = state_tensors(pipeline.replica)
    return [
        part_gram([t[s:e] for t in states] + _shards(incoming, s, e))
        for s, e in aligned_bounds(NUMEL, members)
    ]


def _gathered(plan: RoundPlan, incoming: Sequence[Incoming], members: int) -> list[torch.Tensor]:
    """The all-gather: each member's slice of each combo, joined."""
    slices = [
        ShardRound.weighted_sums(plan, _shards(incoming, s, e))
        for s, e in aligned_bounds(NUMEL, members)
    ]
    return [torch.cat([member[k] for member in slices]) for k in range(len(plan.combos))]


def _by_shards(
    pipeline: UpdatePipeline,
    updates: Sequence[GroupUpdate],
    members: int,
    until_fold: bool = False,
) -> tuple[list, RoundPlan | None]:
    """The round by parts; ``until_fold``: in as many rounds as its folds make, each taking
    the one before's deferred updates (the results of all, the last round's plan; None when
    a round's norm cap was undecided and the rest was applied one by one)."""
    rounds, incoming = _ordered(pipeline, updates)
    results = []
    while True:
        gram = summed_gram(_grams(pipeline, incoming, members))
        try:
            plan = rounds.decide(incoming, gram, until_fold=until_fold)
        except CapUndecided:  # the wiring's fall back: the round fetched whole, one by one
            _note("cap undecided: fetched whole")
            rest = [inc.update for inc in incoming if inc.update is not None]
            return results + _one_by_one(pipeline, rest), None
        results += rounds.apply(plan, _gathered(plan, incoming, members))
        if not plan.deferred:
            return results, plan
        assert until_fold and len(plan.combos) == 1
        incoming = list(plan.deferred)


def _note(name: str) -> None:
    """A hypothesis event where a hypothesis test runs (its statistics count it)."""
    if currently_in_test_context():
        event(name)


def _one_by_one(pipeline: UpdatePipeline, updates: Sequence[GroupUpdate]) -> list:
    ordered = sorted(updates, key=lambda u: (u.head.group_key, u.seq))
    return [pipeline.submit_group(u, _everyone) for u in ordered]


def _outer_state(pipeline: UpdatePipeline) -> dict[str, object]:
    return pipeline.replica.outer.state_dict()


def _assert_alike(a: UpdatePipeline, b: UpdatePipeline) -> None:
    ra, rb = a.replica, b.replica
    assert ra.applied == rb.applied and ra.num_applied == rb.num_applied
    assert ra.progress == rb.progress
    assert ra.cosigned.counts() == rb.cosigned.counts()
    assert a.rejections == b.rejections and a.num_merged == b.num_merged
    assert a.groups.variants._applied == b.groups.variants._applied
    torch.testing.assert_close(ra.params, rb.params, rtol=1e-5, atol=1e-6)
    sa, sb = _outer_state(a), _outer_state(b)
    assert sa.keys() == sb.keys() and sa["count"] == sb["count"]
    for key in ("buf", "acc"):
        if key in sa:
            torch.testing.assert_close(sa[key], sb[key], rtol=1e-5, atol=1e-6)
    assert sa.get("progress") == sb.get("progress")
    assert a.learner_floor.state_dict() == b.learner_floor.state_dict()
    assert_ledgers_alike(a, b)  # the co-signers' budgets
    wa, wb = a.robust.state_dict(), b.robust.state_dict()
    assert wa["authors"] == wb["authors"] and wa["rounds"] == wb["rounds"]
    for x, y in zip(wa["norms"], wb["norms"], strict=True):  # type: ignore[call-overload]
        assert math.isclose(x, y, rel_tol=1e-5)


def assert_ledgers_alike(a: UpdatePipeline, b: UpdatePipeline) -> None:
    """The contribution ledgers hold the same accounts in the same order, their amounts
    equal up to float rounding (a record is earned by the update's substance, from its norm:
    read from the Gram matrix on one path and from the tensor on the other)."""
    la, lb = a.ledger.state_dict(), b.ledger.state_dict()
    assert math.isclose(la["total"], lb["total"], rel_tol=1e-6, abs_tol=1e-9)  # type: ignore[arg-type]
    rows_a, rows_b = la["accounts"], lb["accounts"]
    assert isinstance(rows_a, list) and isinstance(rows_b, list)
    assert [r[0] for r in rows_a] == [r[0] for r in rows_b]
    for ra, rb in zip(rows_a, rows_b, strict=True):
        for x, y in zip(ra[1:], rb[1:], strict=True):
            assert math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9)


specs = st.builds(
    Spec,
    group=st.integers(0, 5),
    round=st.integers(0, 2),
    kind=st.sampled_from(["honest"] * 3 + ["big"] * 2 + ["outlier"] * 2 + ["huge", "against"]),
    variant=st.integers(0, 1),
    staleness=st.sampled_from([0, 0, 0, 3, 3, 2000]),
    low=st.sampled_from([False] * 4 + [True]),
)


def _history(pipeline: UpdatePipeline, seed: int) -> None:
    """Warm: the robust reference and a momentum (5 rounds of 16 learners: no fold yet)."""
    for g in range(5):
        pipeline.submit_group(_update(Spec(g, 0, "honest", 0, 0), seed, 16), _everyone)
