"""What one member of a completed group round receives in its fetch round, message by message,
as real nodes with `--group-scatter --group-shard-fetch` move them (session 26, calib26):
sized with the real wire's own encoders (dht.shard_fetch_wire), so the simulator's count is the
wire's. Pure: bench.scale_sim's accounting calls these.

Per fetch round a member receives from each of the round's g - 1 other members one `propose`
(its base, the ids with holders, the digest of its state blocks: session 28), one `part` (the
upper triangle of its (3 + K)^2 Gram matrix in float32 and one digest of the K variants:
session 29; float64 and K digests in sessions 27-28) and one
`sums` (its slice of each weighted sum, fp32: session 24; 1 sum, 2 when a Delayed Nesterov
fold falls inside the round's batch); and from a holder, per incoming update, one
`group-slice` answer (the update's fields: headers, digests, co-signatures, and exactly its
slice of that update in bf16, with the chunk digests of each shard it meets: session 27).
"""

from __future__ import annotations

import functools
import random

import numpy as np

from dht.shard_fetch_bodies import NAMED_HOLDERS
from dht.shard_fetch_wire import (
    WIDTHS,
    FetchMessage,
    part_message,
    proposal_body,
    slice_answer,
    states_body,
)
from merge.codecs import Codec
from merge.group_chunks import aligned_bounds, chunks_in, overlaps
from merge.group_update import GroupUpdate
from merge.identity import Identity
from merge.shard_fetch import Proposal

NUM_STATES = 3
"""State tensors of the sim's replicas (Delayed Nesterov: params, momentum, round sum)."""
SUMS_WIDTH = WIDTHS["fp32"]
"""Bytes per value of the sums: fp32 (merge.shard_member `MemberRound.sums`)."""
_SENDER = Identity.from_private_bytes(bytes(32))
_DIGEST = 64
"""Hex characters of a chunk digest (merge.group_chunks)."""
_RID = ("group:0b01", 1, 1)
"""A round id of a typical length (the message's JSON names it)."""


def slice_values(numel: int, g: int, rank: int) -> int:
    start, end = aligned_bounds(numel, g)[rank]
    return end - start


def slice_payload(codec: Codec, numel: int, num_shards: int, g: int, rank: int) -> int:
    """The bytes of one member's (rank of g) slice of an update of `num_shards` shards beside
    the answer's fields (`slice_meta`): exactly its slice (the chunk grid, session 27), and
    per shard it meets its index, the piece's length and the shard's chunk digests (JSON hex
    strings). Session 26's overlapping whole shards are counted on its commits only."""
    start, end = aligned_bounds(numel, g)[rank]
    bounds = aligned_bounds(numel, num_shards)
    return codec.payload_bytes(end - start) + pieces_extra(
        numel, bounds, overlaps(bounds, start, end)
    )


def pieces_extra(
    numel: int, bounds: list[tuple[int, int]], pieces: list[tuple[int, int, int]]
) -> int:
    """An answer's JSON for its `pieces` ((shard, start, end) each, of shards at `bounds`):
    each piece's shard index and length and its shard's chunk digests (hex strings), with
    the commas between the entries of the shards', sizes' and lists' arrays."""
    chunks = [len(chunks_in(numel, *bounds[k])) for k, _, _ in pieces]
    lists = sum(2 + (_DIGEST + 2) * n + max(0, n - 1) for n in chunks)
    commas = 3 * max(0, len(pieces) - 1)
    numbers = sum(len(str(k)) + len(str(b - a)) for k, a, b in pieces)
    return lists + commas + numbers


def slice_meta(update: GroupUpdate) -> int:
    """The answer's bytes beside its pieces: framing and the update's fields (headers,
    digests, co-signatures), from the real encoder (they do not grow with the model)."""
    return len(slice_answer(update, 0, 0))  # no piece


def message_bytes(kind: str, body: dict[str, object], num_values: int = 0) -> int:
    """A signed `group-fetch` message's bytes: its JSON (with `body`) and `num_values` fp32."""
    message = FetchMessage("scale-sim", _RID, kind, _SENDER.peer_id, body, ()).signed(_SENDER)
    return len(message.to_bytes()) + SUMS_WIDTH * num_values


@functools.cache
def propose_bytes(num_incoming: int, g: int) -> int:
    """One member's proposal, session 28 (dht.shard_fetch_bodies): K ids, each of another
    group with its own NAMED_HOLDERS holders (named once in the holder table), and the
    SHA-256 of its g state blocks of 6 float64 (the blocks travel only between members whose
    digests differ: `states_bytes`, not counted here, where the members are at one state)."""
    rng = random.Random(g)
    named = min(NAMED_HOLDERS, g)
    candidates = {
        (f"group:0b{k:05b}", 10_000 + k): tuple(_holder(named * k + h) for h in range(named))
        for k in range(num_incoming)
    }
    states = tuple(tuple(rng.uniform(-1e3, 1e3) for _ in range(6)) for _ in range(g))
    proposal = Proposal((10_000, "0" * 64), candidates, states)
    return message_bytes("propose", proposal_body(proposal))


@functools.cache
def states_bytes(g: int) -> int:
    """One member's `states` message: its g state blocks of 6 float64 in full, sent only to
    the members whose proposal's digest differs from its own (merge.shard_states)."""
    rng = random.Random(g)
    states = tuple(tuple(rng.uniform(-1e3, 1e3) for _ in range(6)) for _ in range(g))
    return message_bytes("states", states_body(states))


@functools.cache
def _holder(index: int) -> str:
    """A distinct peer id (Ed25519, as long as every node's) per holder a proposal names."""
    return Identity.from_private_bytes(index.to_bytes(32, "big")).peer_id


@functools.cache
def part_bytes(num_incoming: int) -> int:
    """One member's part, session 29 (dht.shard_fetch_bodies `part_message`): the upper
    triangle of its (3 + K) x (3 + K) Gram matrix as one float32 tensor and one SHA-256 of the
    K variant digests (sessions 27-28: float64 and K digests, base64: 8018 bytes at K = 31)."""
    body, tensors = part_message(_gram(num_incoming), ["0" * 64] * num_incoming)
    message = FetchMessage("scale-sim", _RID, "part", _SENDER.peer_id, body, tensors)
    return len(message.signed(_SENDER).to_bytes())


def _gram(num_incoming: int) -> list[list[float]]:
    """A symmetric matrix of float32 values that are not bf16 values (a part's as sent)."""
    rng = random.Random(num_incoming)
    basis = NUM_STATES + num_incoming
    upper = [
        [float(np.float32(rng.uniform(-1e3, 1e3))) for _ in range(basis)] for _ in range(basis)
    ]
    return [[upper[min(i, j)][max(i, j)] for j in range(basis)] for i in range(basis)]


@functools.cache
def sums_bytes(num_values: int, num_sums: int) -> int:
    """One member's slice (`num_values`) of each of the round's `num_sums` sums, fp32 (the
    JSON's "sizes" list names each slice's length)."""
    sizes = num_sums * len(str(num_values)) + max(0, num_sums - 1)
    return message_bytes("sums", {}, num_sums * num_values) + sizes
