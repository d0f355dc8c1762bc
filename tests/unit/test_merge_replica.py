import hashlib
import io

import pytest
import torch

from merge.envelope import UpdateHeader
from merge.outer import OuterConfig, make_outer_optimizer
from merge.replica import Replica


def header(author: str, seq: int) -> UpdateHeader:
    return UpdateHeader(
        fingerprint="f" * 64,
        author=author,
        seq=seq,
        base_applied=0,
        published_applied=0,
        inner_steps=1,
        tokens=1,
        loss=0.0,
        payload_sha256="0" * 64,
        codec="fp32",
        numel=4,
        created_at=0.0,
    )


def make_replica(kind: str = "delayed_nesterov") -> Replica:
    config = OuterConfig(kind=kind, lr=0.5, momentum=0.5, delay=2)  # type: ignore[arg-type]
    return Replica(torch.tensor([1.0, 2.0, 3.0, 4.0]), make_outer_optimizer(config, 4))


def test_apply_steps_the_params_and_records_the_id() -> None:
    replica = make_replica(kind="nesterov")

    replica.apply(header("alice", 3), torch.tensor([1.0, 0.0, -1.0, 2.0]), 0.5)

    # g' = [0.5, 0, -0.5, 1]; first Nesterov step: p -= 0.5 * 1.5 * g'
    assert replica.params.tolist() == [0.625, 2.0, 3.375, 3.25]
    assert replica.num_applied == 1
    assert replica.has_applied("alice", 3) and not replica.has_applied("alice", 2)
    assert (replica.last_seq("alice"), replica.last_seq("bob")) == (3, -1)
    assert replica.applied == {"alice": [3]}


def test_an_id_is_applied_at_most_once() -> None:
    replica = make_replica()
    replica.apply(header("alice", 0), torch.ones(4), 1.0)
    before, _ = replica.snapshot()

    with pytest.raises(ValueError):
        replica.apply(header("alice", 0), torch.ones(4), 1.0)

    assert torch.equal(replica.params, before) and replica.num_applied == 1


def test_snapshot_is_a_copy_with_its_count() -> None:
    replica = make_replica()
    replica.apply(header("alice", 0), torch.ones(4), 1.0)

    params, num_applied = replica.snapshot()
    params.zero_()

    assert num_applied == 1
    assert replica.params.abs().sum().item() > 0


def test_applied_digest_depends_on_the_set_not_the_order() -> None:
    ids = [("alice", 0), ("bob", 0), ("alice", 1), ("carol", 9), ("alice", 10)]
    forward, backward, partial = make_replica(), make_replica(), make_replica()
    for author, seq in ids:
        forward.apply(header(author, seq), torch.ones(4), 0.1)
    for author, seq in reversed(ids):
        backward.apply(header(author, seq), torch.ones(4), 0.1)
    for author, seq in ids[:-1]:
        partial.apply(header(author, seq), torch.ones(4), 0.1)

    expected_lines = "alice:0\nalice:1\nalice:10\nbob:0\ncarol:9\n"
    assert forward.applied_digest() == hashlib.sha256(expected_lines.encode()).hexdigest()
    assert backward.applied_digest() == forward.applied_digest()
    assert partial.applied_digest() != forward.applied_digest()
    assert make_replica().applied_digest() == hashlib.sha256(b"").hexdigest()


def test_state_dict_round_trips_bit_identically_through_torch_save() -> None:
    generator = torch.Generator().manual_seed(0)
    original = make_replica()
    for seq in range(3):
        original.apply(header("alice", seq), torch.randn(4, generator=generator), 0.7)
    original.apply(header("bob", 5), torch.randn(4, generator=generator), 0.3)
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)

    restored = make_replica()
    restored.load_state_dict(torch.load(buffer, weights_only=True))

    assert torch.equal(restored.params.view(torch.int32), original.params.view(torch.int32))
    assert restored.applied == original.applied == {"alice": [0, 1, 2], "bob": [5]}
    assert restored.num_applied == 4
    assert restored.applied_digest() == original.applied_digest()
    next_g = torch.randn(4, generator=generator)
    original.apply(header("carol", 0), next_g, 1.0)
    restored.apply(header("carol", 0), next_g, 1.0)
    assert torch.equal(restored.params, original.params)


def test_load_state_dict_refuses_inconsistent_state() -> None:
    replica = make_replica()
    replica.apply(header("alice", 0), torch.ones(4), 1.0)
    state = replica.state_dict()
    fresh = make_replica()

    with pytest.raises(ValueError):
        fresh.load_state_dict({**state, "params": torch.zeros(5)})
    with pytest.raises(ValueError):
        fresh.load_state_dict({**state, "num_applied": 2})
    with pytest.raises(ValueError):
        fresh.load_state_dict({**state, "applied": {"alice": [-1]}})
    with pytest.raises(ValueError):
        make_replica(kind="nesterov").load_state_dict(state)
    assert fresh.params.tolist() == [1.0, 2.0, 3.0, 4.0] and fresh.num_applied == 0


def test_replica_refuses_params_the_optimizer_is_not_sized_for() -> None:
    outer = make_outer_optimizer(OuterConfig(), 3)
    with pytest.raises(ValueError):
        Replica(torch.zeros(4), outer)
    with pytest.raises(ValueError):
        Replica(torch.zeros(3, dtype=torch.float64), outer)


def test_progress_counts_updates_by_their_credited_share_and_survives_a_reload() -> None:
    replica = make_replica()
    g = torch.tensor([1.0, 0.0, -1.0, 2.0])
    replica.apply(header("alice", 0), g, 1.0)
    for seq in range(10):  # a budget-cut flood: ten updates credited a tenth each
        replica.apply(header("mallory", seq), g, 0.0, credited=0.1)
    replica.apply(header("bob", 0), g, 1.0)
    assert (replica.num_applied, replica.progress, replica.snapshot()[1]) == (12, 3, 3)

    restored = make_replica()
    restored.load_state_dict(replica.state_dict())
    assert restored.progress == 3
    old = {k: v for k, v in replica.state_dict().items() if k != "num_credited"}
    restored.load_state_dict(old)  # a state from before credited progress: every update whole
    assert restored.progress == 12
    with pytest.raises(ValueError, match="num_credited"):
        restored.load_state_dict({**replica.state_dict(), "num_credited": 13.0})
    assert restored.progress == 12
