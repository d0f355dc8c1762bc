"""A flush judged apart from the rounds' updates (merge.robust, `spans`): its centered-clipping
radius is its author's rounds' together, since its last flush; nothing else about it is.

An honest flush is one dense residual of the rounds it spans, off the momentum by
construction (what the rounds sent built the momentum): judged as one round's update, 7 of 8
were recentered at M = 8, H = 25 (docs/codecs.md). The bounds that hold (hypothesis): a
flush's let-through stays within the norm bound and within its rounds' deviation of the
center; a peer that marks every update as a flush, or alternates rounds and flushes, gets
exactly the verdicts it got before, and nobody's rounds are judged differently.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.envelope import SignedUpdate
from merge.identity import Identity
from merge.outer import OuterConfig, make_outer_optimizer
from merge.pipeline import MergeConfig, UpdatePipeline
from merge.replica import Replica
from merge.robust import RobustConfig, RobustFilter, Verdict
from merge.weighting import TokenWeightConfig
from tests.factories import FINGERPRINT, encoded, identity, sealed_update

NUMEL = 64
DIRECTION = torch.linspace(-1, 1, NUMEL) / torch.linspace(-1, 1, NUMEL).norm()
SIDEWAYS = torch.cat([torch.ones(NUMEL // 2), -torch.ones(NUMEL // 2)])
SIDEWAYS = SIDEWAYS - torch.dot(SIDEWAYS, DIRECTION) * DIRECTION
SIDEWAYS = SIDEWAYS / SIDEWAYS.norm()  # orthogonal to the training direction
CONFIG = MergeConfig(
    outer=OuterConfig(kind="nesterov", lr=0.1, momentum=0.9),
    token_weight=TokenWeightConfig(reference_tokens=1000),
    max_inner_steps=100,
    max_tokens_per_step=100,
)
AUTHORS = [identity(f"flusher {i}") for i in range(3)]


# -- the filter alone -------------------------------------------------------------------------

Event = tuple[int, bool, torch.Tensor]


def events_of(draw_seed: int, plan: list[tuple[int, bool, float, float]]) -> list[Event]:
    """(author, flush, vector): each vector the momentum's direction times `along` plus
    noise of norm `aside` (negative `along`: against it)."""
    g = torch.Generator().manual_seed(draw_seed)
    out = []
    for author, flush, along, aside in plan:
        noise = torch.randn(NUMEL, generator=g)
        out.append((author, flush, along * DIRECTION + aside * noise / noise.norm()))
    return out


def replay(events: list[Event], apart: bool) -> list[tuple[Verdict, int]]:
    """Each event judged, recorded and flushed as the pipeline does (an update against the
    momentum moves nothing and is not recorded); `apart=False`: every flush judged as a
    round's update (spans 1), as before flushes were judged apart."""
    robust = RobustFilter(RobustConfig())
    momentum = 0.5 * DIRECTION
    out = []
    for author, flush, g in events:
        name = f"author {author}"
        spans = robust.spans(name) if flush and apart else 1
        verdict = robust.judge(g, momentum, spans=spans)
        if verdict.reason != "against_momentum":
            robust.record(verdict, name, flush=flush)
        if flush:
            robust.flushed(name)
        out.append((verdict, spans))
    return out


PLANS = st.lists(
    st.tuples(st.integers(0, 2), st.booleans(), st.floats(-1.0, 3.0), st.floats(0.0, 6.0)),
    min_size=1,
    max_size=40,
)


def let_through(verdict: Verdict, g: torch.Tensor) -> torch.Tensor:
    """What the update contributes, before its weight: the clipped tensor, times the norm
    bound's scale when that is left to the weight (RobustFilter.clipped)."""
    clipped = RobustFilter(RobustConfig()).clipped(g, [0.5 * DIRECTION], verdict)
    return clipped if verdict.recenter is not None else clipped * verdict.scale


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31), plan=PLANS)
def test_a_flush_lets_through_no_more_than_the_norm_bound_and_its_rounds_deviation(
    seed: int, plan: list[tuple[int, bool, float, float]]
) -> None:
    """A flush's step is bounded by what its author's applied rounds allow: within the norm
    bound (k x the reference) like any update, and within `spans` x the round's radius of
    the center, `spans` its author's applied rounds since its last flush (at least 1)."""
    config = RobustConfig()
    events = events_of(seed, plan)
    rounds: dict[int, int] = {}
    for (author, flush, g), (verdict, spans) in zip(events, replay(events, True), strict=True):
        if flush:
            assert spans == max(1, min(rounds.get(author, 0), config.window))
            rounds[author] = 0
        elif verdict.reason != "against_momentum":
            rounds[author] = rounds.get(author, 0) + 1
        if verdict.reason == "against_momentum" or verdict.median_norm is None:
            continue
        out = let_through(verdict, g)
        reference = verdict.median_norm
        assert float(out.norm()) <= config.max_norm_to_median * reference * (1 + 1e-4) + 1e-6
        deviation = float((out - reference * DIRECTION).norm())
        radius = spans * config.center_radius * reference
        assert deviation <= radius * (1 + 1e-4) + 1e-6


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31), plan=PLANS)
def test_rounds_and_flushes_after_no_round_are_judged_as_before(
    seed: int, plan: list[tuple[int, bool, float, float]]
) -> None:
    """Judging flushes apart changes the verdict of a flush that spans 2 rounds or more and
    nothing else: every round's update, and every flush with no round of its author since
    its last flush (a flood of flushes, rounds and flushes alternating), gets the verdict it
    got when every flush was judged as a round's update; so a flood of flushes moves the
    replica no more than before, and the reference norm sees the same window."""
    events = events_of(seed, plan)
    apart, before = replay(events, True), replay(events, False)
    for (_, flush, _), (now, spans), (then, _) in zip(events, apart, before, strict=True):
        if not flush or spans == 1:
            assert now == then
        else:  # only its recentering can differ: the same norm, reference, cosine, scale
            assert (now.norm, now.median_norm, now.cosine, now.scale) == (
                then.norm, then.median_norm, then.cosine, then.scale,
            )  # fmt: skip
            assert now.recenter is None or then.recenter is None or now.recenter >= then.recenter


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**31), plan=PLANS)
def test_an_author_marking_every_update_a_flush_gets_the_verdicts_of_before(
    seed: int, plan: list[tuple[int, bool, float, float]]
) -> None:
    """Author 0 floods flushes only, beside the others' rounds and flushes: each of its
    updates spans 1 round and is judged exactly as before."""
    events = [(a, True if a == 0 else f, g) for a, f, g in events_of(seed, plan)]
    for (author, _, _), (now, spans), (then, _) in zip(
        events, replay(events, True), replay(events, False), strict=True
    ):
        if author == 0:
            assert spans == 1 and now == then


def test_an_honest_flush_off_the_momentum_is_recentered_only_as_one_round() -> None:
    """The residual of 8 rounds, orthogonal to the momentum at 2.5x the reference: judged as
    one round's update it deviates past the radius (off_center); spanning its 8 rounds it
    is let through whole."""
    robust = RobustFilter(RobustConfig())
    for _ in range(8):
        robust.record(robust.judge(DIRECTION, DIRECTION), "a")
    residual = 2.5 * SIDEWAYS
    assert robust.spans("a") == 8
    assert robust.judge(residual, DIRECTION).reason == "off_center"
    whole = robust.judge(residual, DIRECTION, spans=8)
    assert (whole.reason, whole.scale, whole.recenter) == (None, 1.0, None)
    robust.flushed("a")
    assert robust.spans("a") == 1
    assert robust.judge(residual, DIRECTION, spans=robust.spans("a")).reason == "off_center"


def test_a_flush_beyond_the_norm_bound_or_against_the_momentum_is_judged_as_a_round() -> None:
    robust = RobustFilter(RobustConfig())
    for _ in range(8):
        robust.record(robust.judge(DIRECTION, DIRECTION), "a")
    for g in (6.0 * SIDEWAYS, 6.0 * DIRECTION, -DIRECTION):
        assert robust.judge(g, DIRECTION, spans=8) == robust.judge(g, DIRECTION)
    assert robust.judge(-DIRECTION, DIRECTION, spans=8).reason == "against_momentum"


def test_the_rounds_a_flush_spans_are_capped_at_the_window() -> None:
    robust = RobustFilter(RobustConfig(window=4))
    for _ in range(10):
        robust.record(robust.judge(DIRECTION, DIRECTION), "a")
    assert robust.spans("a") == 4
    assert robust.spans("nobody") == 1


# -- checkpoints and hostile states -----------------------------------------------------------


def test_the_rounds_since_each_flush_survive_a_checkpoint() -> None:
    robust = RobustFilter(RobustConfig())
    for author, rounds in (("a", 3), ("b", 5)):
        for _ in range(rounds):
            robust.record(robust.judge(DIRECTION, DIRECTION), author)
    robust.flushed("b")
    loaded = RobustFilter(RobustConfig())
    loaded.load_state_dict(robust.state_dict())
    assert (loaded.spans("a"), loaded.spans("b")) == (3, 1)
    assert loaded.state_dict() == robust.state_dict()


def test_a_state_saved_before_flushes_were_judged_apart_loads_with_no_rounds() -> None:
    loaded = RobustFilter(RobustConfig())
    loaded.load_state_dict({"norms": [1.0, 1.0], "authors": ["a", "a"]})
    assert loaded.spans("a") == 1 and len(loaded) == 2


@pytest.mark.parametrize(
    "rounds",
    [
        {"round_authors": ["a"], "rounds": [33]},  # past the window
        {"round_authors": ["a"], "rounds": [-1]},
        {"round_authors": ["a"], "rounds": [1.5]},
        {"round_authors": ["a"], "rounds": [True]},
        {"round_authors": ["a", "a"], "rounds": [1, 2]},
        {"round_authors": ["a"], "rounds": [1, 2]},
        {"round_authors": ["z"], "rounds": [1]},  # an author without norms
        {"round_authors": [7], "rounds": [1]},
        {"round_authors": "a", "rounds": [1]},
    ],
)
def test_a_hostile_rounds_state_is_refused(rounds: dict[str, Any]) -> None:
    robust = RobustFilter(RobustConfig())
    with pytest.raises(ValueError):
        robust.load_state_dict({"norms": [1.0], "authors": ["a"]} | rounds)


# -- through the pipeline ---------------------------------------------------------------------


def make_pipeline() -> UpdatePipeline:
    replica = Replica(torch.full((NUMEL,), 10.0), make_outer_optimizer(CONFIG.outer, NUMEL))
    pipeline = UpdatePipeline(replica, CONFIG, FINGERPRINT)
    pipeline.clock = lambda: 1000.0
    return pipeline


def update(author: Identity, seq: int, delta: torch.Tensor, **overrides: Any) -> SignedUpdate:
    fields: dict[str, Any] = dict(fingerprint=FINGERPRINT, numel=NUMEL, created_at=999.0)
    return sealed_update(author, seq=seq, payload=encoded(delta), **(fields | overrides))


def honest(author: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * author + seq)
    noise = torch.randn(NUMEL, generator=g)
    return DIRECTION + 0.3 * noise / noise.norm()


def swarm_of_rounds(rounds: int) -> UpdatePipeline:
    pipeline = make_pipeline()
    for seq in range(1, rounds + 1):
        for author in range(2):
            assert pipeline.submit(update(AUTHORS[author], seq, honest(author, seq))).accepted
    return pipeline


@pytest.mark.parametrize("flush", [False, True])
def test_a_residual_off_the_momentum_passes_whole_as_a_flush_and_is_recentered_unmarked(
    flush: bool,
) -> None:
    pipeline = swarm_of_rounds(8)
    residual = 2.5 * SIDEWAYS
    before = pipeline.replica.params.clone()

    result = pipeline.submit(update(AUTHORS[0], 9, residual, flush=flush))

    assert result.accepted
    if flush:  # a plain step of exactly the residual: nothing recentered
        assert result.robust is None
        expected = before - CONFIG.outer.lr * result.weight / result.learners * residual
        torch.testing.assert_close(pipeline.replica.params, expected, rtol=0, atol=1e-5)
    else:
        assert result.robust == "off_center"


def test_a_second_flush_with_no_round_between_is_judged_as_a_round() -> None:
    pipeline = swarm_of_rounds(8)
    first = pipeline.submit(update(AUTHORS[0], 9, 2.5 * SIDEWAYS, flush=True))
    second = pipeline.submit(update(AUTHORS[0], 10, 2.5 * SIDEWAYS, flush=True))
    assert first.robust is None and second.robust == "off_center"
    assert pipeline.robust.spans(AUTHORS[0].peer_id) == 1
    assert pipeline.robust.spans(AUTHORS[1].peer_id) == 8


def test_the_rounds_a_flush_spans_travel_with_the_merge_state() -> None:
    pipeline = swarm_of_rounds(3)
    newcomer = make_pipeline()
    newcomer.load_state_dict(pipeline.state_dict())
    assert newcomer.robust.spans(AUTHORS[0].peer_id) == 3
    assert math.isclose(newcomer.robust.median_norm() or 0, pipeline.robust.median_norm() or 1)
