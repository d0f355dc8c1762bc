"""A fetch round's parts in float32 (session 29, merge.shard_part) through the real exchange
code on test_fetch_round_sums' in-memory pipe: three members apply the round alike with the
new parts, a member sending a session 28 part is counted `group_fetch_old_version`, and a
member whose float32 part lies about an update's slice is counted against (its sums do not
match it); the others fall back and end where applying the updates one by one does."""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable

import numpy as np
import pytest
import torch

from dht.shard_fetch_wire import FetchMessage, decode_fetch
from merge.identity import Identity
from merge.shard_part import mirrored, triangle_side
from tests.unit.shard_round_paths import NUMEL, _assert_alike
from tests.unit.test_fetch_round_sums import MEMBERS, OTHERS, _reference, _round

LIAR = sorted(MEMBERS, key=lambda m: m.peer_id)[0]


def _parts_of(liar: Identity, change: Callable[[FetchMessage], FetchMessage]):
    """A tamper that replaces `liar`'s part with `change` of it, signed by the liar."""

    def tamper(sender: str, blob: bytes) -> bytes:
        message = decode_fetch(blob, NUMEL)
        if sender != liar.peer_id or message.kind != "part":
            return blob
        return change(message).signed(liar).to_bytes()

    return tamper


def _session_28(message: FetchMessage) -> FetchMessage:
    """The same part as sessions 27-28 sent it: float64 triangle and digests in the body."""
    (triangle,) = message.tensors
    values = triangle.to(torch.float64).tolist()
    body = {
        "upper": base64.b64encode(struct.pack(f"<{len(values)}d", *values)).decode(),
        "digests": base64.b64encode(bytes(32) * 2).decode(),
    }
    return FetchMessage(message.run_id, message.round_id, "part", message.sender, body, ())


def _shorter_update(message: FetchMessage) -> FetchMessage:
    """The part as if the liar's slice of the round's first update were half as long (still
    a Gram matrix of real vectors): its group's decision leans, its honest sums betray it."""
    (triangle,) = message.tensors
    upper = triangle.to(torch.float64).tolist()
    size = triangle_side(len(upper))
    assert size is not None
    gram = np.array(mirrored(upper, size))
    index = 3  # params, momentum, round sum, then the updates
    gram[index, :] *= 0.5
    gram[:, index] *= 0.5
    told = [gram[i, j] for i in range(size) for j in range(i, size)]
    tensors = (torch.tensor(told, dtype=torch.float32),)
    return FetchMessage(
        message.run_id, message.round_id, "part", message.sender, message.body, tensors
    )


def _others() -> list:
    return sorted(OTHERS, key=lambda u: (u.head.group_key, u.seq))[:2]


def test_members_apply_a_round_of_float32_parts_alike_and_as_one_by_one() -> None:
    seen: list[tuple[str, int]] = []

    def watch(sender: str, blob: bytes) -> bytes:
        message = decode_fetch(blob, NUMEL)
        if message.kind == "part":
            assert set(message.body) == {"v", "variants"}
            seen.append((sender, message.tensors[0].numel()))
        return blob

    members, _ = _round(_others(), watch)
    for member in members:
        (event,) = [e for e in member.events if e["event"] == "shard_round"]
        assert event["outcome"] == "applied" and member.rejections == []
    assert len(seen) == 3 * 2 and {n for _, n in seen} == {5 * 6 // 2}
    first = members[0].pipeline
    for other in members[1:]:
        assert torch.equal(other.pipeline.replica.params, first.replica.params)
    _assert_alike(_reference(_others()), first)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (_session_28, "group_fetch_old_version"),
        (_shorter_update, "group_fetch_sums_refused"),
    ],
)
def test_a_member_s_old_or_lying_part_is_a_counted_rejection(
    change: Callable[[FetchMessage], FetchMessage], reason: str
) -> None:
    members, _ = _round(_others(), _parts_of(LIAR, change))
    honest = [m for m in members if m.exchange.identity.peer_id != LIAR.peer_id]
    for member in honest:
        assert (reason, LIAR.peer_id) in member.rejections
        (event,) = [e for e in member.events if e["event"] == "shard_round"]
        assert event["outcome"] != "applied"
        assert member.pipeline.replica.num_applied == _reference(_others()).replica.num_applied
    reference = _reference(_others())
    for member in honest:
        _assert_alike(reference, member.pipeline)
