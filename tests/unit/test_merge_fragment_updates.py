"""Fragment updates: the v4 header, per-fragment outer state, validation, the node's schedule."""

import hashlib
import json
import struct
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.codecs import get_codec
from merge.envelope import EnvelopeError, SignedHeader, SignedUpdate
from merge.fragments import FragmentLayout
from merge.outer import OuterConfig, make_outer_optimizer
from merge.pipeline import MergeConfig, UpdatePipeline
from merge.replica import Replica
from merge.weighting import StalenessConfig, TokenWeightConfig
from node.streaming import FragmentCompressors, FragmentStream
from tests.factories import ALICE, sealed_update

FINGERPRINT = hashlib.sha256(b"fragments").hexdigest()
SIZES = [6, 2, 5, 3, 4]  # five tensors; P = 2 packs {0, 1, 3} (11) and {2, 4} (9)
CONFIG = MergeConfig(
    outer=OuterConfig(kind="nesterov", lr=0.5, momentum=0.5),
    staleness=StalenessConfig(kind="constant"),
    token_weight=TokenWeightConfig(kind="none", reference_tokens=1000),
    max_inner_steps=100,
    max_tokens_per_step=100,
)


def fragment_replica(
    params: torch.Tensor, sizes: list[int], num_fragments: int, outer: OuterConfig
) -> Replica:
    layout = FragmentLayout(sizes, num_fragments)
    outers = [
        make_outer_optimizer(outer, layout.fragment_numel(p)) for p in range(layout.num_fragments)
    ]
    return Replica(params.clone(), outers, layout)


def update(
    g: torch.Tensor, seq: int, fragment: int | None = None, fragments: int | None = None,
    learners: int = 1, **overrides: Any,
) -> SignedUpdate:  # fmt: skip
    fields: dict[str, Any] = dict(
        fingerprint=FINGERPRINT, seq=seq, tokens=100, delta=g, learners=learners,
        fragment=fragment, fragments=fragments, created_at=1_700_000_000.0,
    )  # fmt: skip
    return sealed_update(ALICE, **(fields | overrides))


# ---- layout ------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(data=st.data(), sizes=st.lists(st.integers(1, 50), min_size=1, max_size=12))
def test_fragments_gather_and_scatter_back_every_element(
    data: st.DataObject, sizes: list[int]
) -> None:
    layout = FragmentLayout(sizes, data.draw(st.integers(1, len(sizes))))
    flat = torch.arange(sum(sizes), dtype=torch.float32)
    rebuilt = torch.zeros_like(flat)

    parts = [layout.gather(flat, p) for p in range(layout.num_fragments)]
    for p, part in enumerate(parts):
        layout.scatter(rebuilt, p, part)

    assert torch.equal(rebuilt, flat)
    assert sorted(torch.cat(parts).tolist()) == flat.tolist()  # each element in one fragment
    assert [part.numel() for part in parts] == [
        layout.fragment_numel(p) for p in range(layout.num_fragments)
    ]


# ---- per-fragment outer step -------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(
    data=st.data(),
    sizes=st.lists(st.integers(1, 9), min_size=2, max_size=8),
    kind=st.sampled_from(["nesterov", "delayed_nesterov"]),
    learners=st.integers(1, 3),
    rounds=st.integers(1, 3),
)
def test_all_fragments_of_each_update_equal_the_whole_update(
    data: st.DataObject, sizes: list[int], kind: str, learners: int, rounds: int
) -> None:
    """Rounds of M whole updates against the same updates cut into P fragments each."""
    num_fragments = data.draw(st.integers(2, len(sizes)))
    numel = sum(sizes)
    gen = torch.Generator().manual_seed(len(sizes) * 31 + num_fragments)
    start = torch.randn(numel, generator=gen)
    outer = OuterConfig(kind=kind, lr=0.7, momentum=0.9)  # type: ignore[arg-type]
    whole = Replica(start.clone(), make_outer_optimizer(outer, numel))
    split = fragment_replica(start, sizes, num_fragments, outer)
    layout = split.layout
    assert layout is not None
    for seq in range(rounds * learners):
        g = torch.randn(numel, generator=gen) * 0.1
        whole.apply(update(g, seq, learners=learners).header, g, 0.8)
        for p in range(layout.num_fragments):
            part = layout.gather(g, p)
            header = update(part, seq * 100 + p + 1, p, layout.num_fragments, learners).header
            split.apply(header, part, 0.8)

    torch.testing.assert_close(split.params, whole.params, rtol=1e-5, atol=1e-6)
    for p in range(layout.num_fragments):
        torch.testing.assert_close(
            split.outer_for(p).momentum_buffer, layout.gather(whole.outer.momentum_buffer, p)
        )


@pytest.mark.parametrize("kind", ["nesterov", "delayed_nesterov"])
def test_one_fragment_leaves_the_other_tensors_and_their_momentum_alone(kind: str) -> None:
    outer = OuterConfig(kind=kind, lr=0.5, momentum=0.5)  # type: ignore[arg-type]
    start = torch.arange(1.0, 21.0)
    replica = fragment_replica(start, SIZES, 2, outer)
    layout = replica.layout
    assert layout is not None and layout.tensors == ((0, 1, 3), (2, 4))
    g1 = torch.ones(layout.fragment_numel(1))
    replica.apply(update(g1, 1, 1, 2, learners=1).header, g1, 1.0)
    before = replica.state_dict()

    g0 = torch.ones(layout.fragment_numel(0))
    replica.apply(update(g0, 2, 0, 2, learners=1).header, g0, 1.0)

    after = replica.state_dict()
    assert torch.equal(layout.gather(after["params"], 1), layout.gather(before["params"], 1))
    assert not torch.equal(layout.gather(after["params"], 0), layout.gather(start, 0))
    outer_before, outer_after = before["outer"]["fragments"], after["outer"]["fragments"]  # type: ignore[index]
    assert torch.equal(outer_after[1]["buf"], outer_before[1]["buf"])
    assert outer_after[1]["count"] == outer_before[1]["count"] == 1
    assert outer_after[0]["count"] == 1 and bool(outer_after[0]["buf"].abs().sum() > 0)


def test_delayed_nesterov_folds_each_fragment_on_its_own_round() -> None:
    """M = 2: the fold comes with a fragment's second share, whatever the others received."""
    outer = OuterConfig(kind="delayed_nesterov", lr=0.5, momentum=0.5)
    replica = fragment_replica(torch.zeros(20), SIZES, 2, outer)
    g0, g1 = torch.ones(11), torch.ones(9)
    replica.apply(update(g0, 1, 0, 2, learners=2).header, g0, 1.0)
    replica.apply(update(g1, 2, 1, 2, learners=2).header, g1, 1.0)
    replica.apply(update(g0, 3, 0, 2, learners=2).header, g0, 1.0)

    state = replica.state_dict()["outer"]["fragments"]  # type: ignore[index]
    assert state[0]["progress"] == 0.0 and torch.equal(state[0]["buf"], torch.ones(11))
    assert state[1]["progress"] == 0.5 and torch.equal(state[1]["buf"], torch.zeros(9))


def test_fragment_outer_state_survives_a_state_dict_round_trip() -> None:
    outer = OuterConfig(kind="delayed_nesterov")
    a = fragment_replica(torch.zeros(20), SIZES, 2, outer)
    g = torch.ones(11)
    a.apply(update(g, 1, 0, 2, learners=3).header, g, 1.0)
    b = fragment_replica(torch.zeros(20), SIZES, 2, outer)

    b.load_state_dict(a.state_dict())

    assert torch.equal(b.params, a.params) and b.applied == a.applied
    assert b.state_dict()["outer"]["fragments"][0]["progress"] == pytest.approx(1 / 3)  # type: ignore[index]
    broken = a.state_dict() | {"outer": {"fragments": [a.outer_for(0).state_dict()]}}
    with pytest.raises(ValueError, match="2 fragment outer states"):
        b.load_state_dict(broken)


# ---- header ------------------------------------------------------------------------------


def test_fragment_fields_are_signed_in_a_v4_header() -> None:
    g = torch.ones(11)
    sealed = update(g, 1, 0, 2)
    parsed = SignedUpdate.from_bytes(sealed.to_bytes())

    assert parsed.header.version == 4 and parsed.header.to_dict()["v"] == 4
    assert (parsed.header.fragment, parsed.header.fragments) == (0, 2)
    assert update(g, 1).header.version == 3  # whole updates keep sealing v3
    forged = SignedHeader(parsed.header.__class__(**{**vars(parsed.header), "fragment": 1}),
                          parsed.signature)  # fmt: skip
    pipeline = UpdatePipeline(fragment_replica(torch.ones(20), SIZES, 2, CONFIG.outer), CONFIG,
                              FINGERPRINT)  # fmt: skip
    assert pipeline.check_header(forged) == "bad_signature"


def _header_blob(d: dict[str, Any]) -> bytes:
    header_json = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
    return b"DLH1" + struct.pack("<I", len(header_json)) + header_json + bytes(64)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(fragment=2),  # not below fragments
        lambda d: d.update(fragment=-1),
        lambda d: d.update(fragment=True),
        lambda d: d.update(fragment=None),  # fragments without a fragment
        lambda d: d.update(fragments=None),
        lambda d: d.update(fragments=1.0),
        lambda d: d.pop("fragment"),
        lambda d: d.update(v=3),  # v3 has no fragment fields
        lambda d: d.update(payload_sha256="0" * 64, payload_blake3=None),
    ],
)
def test_malformed_fragment_fields_are_refused(mutate: Callable[[dict[str, Any]], object]) -> None:
    d = update(torch.ones(11), 1, 0, 2).header.to_dict()
    mutate(d)
    with pytest.raises(EnvelopeError) as excinfo:
        SignedHeader.from_bytes(_header_blob(d))
    assert excinfo.value.reason == "malformed"


# ---- validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fragments", "make", "reason"),
    [
        (2, lambda: update(torch.ones(9), 1, 0, 3), "bad_fragment"),  # another P
        (2, lambda: update(torch.ones(20), 1), "bad_fragment"),  # whole update in a P = 2 run
        (1, lambda: update(torch.ones(9), 1, 0, 2), "bad_fragment"),  # fragment in a P = 1 run
        (2, lambda: update(torch.ones(9), 1, 0, 2), "wrong_size"),  # fragment 1's size as 0
        (2, lambda: update(torch.ones(20), 1, 1, 2), "wrong_size"),
    ],
)
def test_updates_that_do_not_fit_the_runs_fragments_are_counted_rejections(
    fragments: int, make: Callable[[], SignedUpdate], reason: str
) -> None:
    replica = (
        fragment_replica(torch.ones(20), SIZES, fragments, CONFIG.outer)
        if fragments > 1
        else Replica(torch.ones(20), make_outer_optimizer(CONFIG.outer, 20))
    )
    pipeline = UpdatePipeline(replica, CONFIG, FINGERPRINT)
    sealed = make()

    result = pipeline.submit(sealed)

    assert not result.accepted and result.reason == reason
    assert pipeline.check_header(sealed.signed_header) == reason
    assert pipeline.rejections[reason] == 1 and replica.num_applied == 0
    assert torch.equal(replica.params, torch.ones(20))


def test_a_fragment_update_is_applied_once_through_the_pipeline() -> None:
    replica = fragment_replica(torch.ones(20), SIZES, 2, CONFIG.outer)
    pipeline = UpdatePipeline(replica, CONFIG, FINGERPRINT)
    g = torch.full((9,), 0.1)
    sealed = update(g, 1, 1, 2)

    first = pipeline.submit(SignedUpdate.from_bytes(sealed.to_bytes()))
    again = pipeline.submit(sealed)

    assert first.accepted and not again.accepted and again.reason == "duplicate"
    assert replica.applied == {ALICE.peer_id: [1]}
    layout = replica.layout
    assert layout is not None
    assert torch.equal(layout.gather(replica.params, 0), torch.ones(11))
    assert bool((layout.gather(replica.params, 1) < 1).all())


# ---- the node's schedule -----------------------------------------------------------------


def test_stream_publishes_each_fragment_after_its_step_and_rebases_it() -> None:
    layout = FragmentLayout(SIZES, 2)
    stream = FragmentStream(layout, 4, torch.zeros(20), base_applied=3)
    assert [stream.due(step) for step in range(1, 5)] == [[], [0], [], [1]]
    assert stream.unpublished(3) == [1] and stream.unpublished(4) == []
    stream.record_step(tokens=10, loss=2.0)
    stream.record_step(tokens=10, loss=4.0)
    inner = torch.full((20,), -1.0)

    g = stream.pseudo_gradient(0, inner)
    stream.adopt(0, torch.full((11,), 5.0), applied=7)

    assert torch.equal(g, torch.ones(11))  # base 0 minus inner -1
    assert stream.rounds[0].steps == 0 and stream.rounds[0].base_applied == 7
    assert (stream.rounds[1].steps, stream.rounds[1].tokens, stream.rounds[1].loss) == (2, 20, 3.0)
    assert torch.equal(layout.gather(stream.base, 0), torch.full((11,), 5.0))
    assert torch.equal(layout.gather(stream.base, 1), torch.zeros(9))


def test_fragment_error_feedback_is_saved_as_one_flat_residual() -> None:
    layout = FragmentLayout(SIZES, 2)
    a = FragmentCompressors(get_codec("int4"), layout)
    gen = torch.Generator().manual_seed(1)
    for p in range(2):
        a.encode(p, torch.randn(layout.fragment_numel(p), generator=gen))
    b = FragmentCompressors(get_codec("int4"), layout)

    b.load_state_dict(a.state_dict())

    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a["residual"].shape == (20,)  # type: ignore[union-attr]
    assert bool(state_a["residual"].abs().sum() > 0)  # type: ignore[union-attr]
    assert torch.equal(state_a["residual"], state_b["residual"])  # type: ignore[arg-type]


def test_fragments_flag_is_checked_and_enters_the_fingerprint_only_above_one() -> None:
    from node.builders import fingerprint_spec
    from node.config import JoinConfig
    from node.model import model_config

    with pytest.raises(ValueError, match="--fragments must be at most --inner-steps"):
        JoinConfig(fragments=5, inner_steps=4, swarm=False)
    with pytest.raises(ValueError, match="fragments"):
        JoinConfig(fragments=0, swarm=False)

    def spec(**fields: Any) -> dict[str, Any]:
        return fingerprint_spec(
            JoinConfig(swarm=False, **fields), model_config("tiny", 256), CONFIG
        )

    assert "fragments" not in spec() and spec(fragments=4)["fragments"] == 4


def test_a_fragment_is_as_stale_as_a_whole_update_of_the_same_swarm_would_be() -> None:
    """P fragments of every round are applied: P x the updates for the same rounds of age."""
    from merge.pipeline import staleness_of

    whole = update(torch.ones(20), 1, base_applied=3, published_applied=10).header
    fragment = update(torch.ones(11), 2, 0, 2, base_applied=3, published_applied=10).header

    assert (staleness_of(whole), staleness_of(fragment)) == (7, 3)


def test_a_fragment_may_outgrow_its_own_tensors_but_not_the_model() -> None:
    """Fragment 1 holds 9 of 20 params: a norm above theirs but below the model's is honest."""
    params = torch.cat([torch.full((11,), 3.0), torch.full((9,), 0.1)])  # model norm ~9.95
    layout = FragmentLayout(SIZES, 2)
    start = torch.empty(20)
    layout.scatter(start, 0, params[:11])
    layout.scatter(start, 1, params[11:])

    def submit(value: float, seq: int) -> str | None:
        replica = fragment_replica(start, SIZES, 2, CONFIG.outer)
        pipeline = UpdatePipeline(replica, CONFIG, FINGERPRINT)
        return pipeline.submit(update(torch.full((9,), value), seq, 1, 2)).reason

    assert submit(1.0, 1) is None  # norm 3 against fragment norm 0.3, model norm ~9.95
    assert submit(4.0, 2) == "norm_too_large"  # norm 12
