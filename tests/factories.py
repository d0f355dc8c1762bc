"""The one factory of keys and sealed (signed) updates the tests share.

Every test that needs an update a peer could have sent builds it here, so a change to the
envelope (a new header field, a new version) is made in one place. Defaults describe a small,
honest, fp32 update of a one-run swarm; a test names only the fields its assertion is about.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from dht.grouping_shards import ShardedRound
from merge.codecs import get_codec
from merge.envelope import SignedUpdate, seal
from merge.group_shards import sharded_contribution
from merge.group_update import RoundFields
from merge.identity import Identity
from merge.pipeline import UpdatePipeline

FINGERPRINT = hashlib.sha256(b"run").hexdigest()
"""The model fingerprint of the tests' run (any 64 hex digits would do)."""


def identity(seed: bytes | str) -> Identity:
    """The same Ed25519 key for the same seed: one character repeated 32 times (the keys the
    tests have always used, ALICE = identity("a")), any longer seed hashed."""
    raw = seed.encode() if isinstance(seed, str) else seed
    return Identity.from_private_bytes(raw * 32 if len(raw) == 1 else hashlib.sha256(raw).digest())


ALICE = identity("a")
MALLORY = identity("m")


def encoded(delta: torch.Tensor | Sequence[float], codec: str = "fp32") -> bytes:
    """A pseudo-gradient as its codec puts it on the wire."""
    tensor = torch.as_tensor(delta, dtype=torch.float32).contiguous()
    return get_codec(codec).encode(tensor)


def sealed_update(
    author: Identity = ALICE,
    *,
    delta: torch.Tensor | Sequence[float] | None = None,
    payload: bytes | None = None,
    codec: str = "fp32",
    fingerprint: str = FINGERPRINT,
    seq: int = 0,
    base_applied: int = 0,
    published_applied: int = 0,
    inner_steps: int = 10,
    tokens: int = 1000,
    loss: float = 2.0,
    numel: int | None = None,
    created_at: float | None = 1.0,
    learners: int = 1,
    fragment: int | None = None,
    fragments: int | None = None,
    flush: bool = False,
) -> SignedUpdate:
    """An update signed by ``author``: its payload given as bytes or encoded from ``delta``
    (zeros when neither is given); ``numel`` defaults to the delta's size or fp32's count of
    the payload; ``created_at=None`` stamps the current time, as a node does."""
    if payload is None:
        payload = encoded(torch.zeros(numel or 4) if delta is None else delta, codec)
    if numel is None:
        numel = len(payload) // 4 if delta is None else torch.as_tensor(delta).numel()
    return seal(
        author, fingerprint=fingerprint, seq=seq, base_applied=base_applied,
        published_applied=published_applied, inner_steps=inner_steps, tokens=tokens, loss=loss,
        codec=codec, numel=numel, payload=payload, created_at=created_at, learners=learners,
        fragment=fragment, fragments=fragments, flush=flush,
    )  # fmt: skip


Decisions = dict[tuple[str, int], tuple[float, int, str | None]]
"""What a replica decided about each update it applied: (author, seq) -> weight, learners,
robust verdict."""


def submit_in_order(
    pipeline: UpdatePipeline, updates: Sequence[SignedUpdate], order: Sequence[int]
) -> Decisions:
    """Feed `updates` to `pipeline` in `order`, each one applied, and what it decided."""
    decided: Decisions = {}
    for i in order:
        r = pipeline.submit(updates[i])
        assert r.accepted, r.reason
        decided[(r.author, r.seq)] = (r.weight, r.learners, r.robust)
    return decided


def bf16_values(seed: int, numel: int) -> torch.Tensor:
    """`numel` seeded normal values that bf16 holds exactly (a group member's part sent in bf16
    reduces to the same sum on every member)."""
    t = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    return t.to(torch.bfloat16).to(torch.float32)


def sharded_rounds(
    ids: Sequence[Identity],
    fields: RoundFields,
    numel: int,
    *,
    wait_s: float,
    cosign_s: float,
    grace_s: float = 0.0,
) -> dict[str, ShardedRound]:
    """One reduce-scatter round (dht.grouping_shards) per member of `ids`, each member's part
    `bf16_values(k, numel)`, all opened at 0 s with one member list (and `grace_s`)."""
    members = [i.peer_id for i in ids]
    rounds = {}
    for k, ident in enumerate(ids):
        part = bf16_values(k, numel)
        header, digests = sharded_contribution(part, ident, fields, 10, len(ids))
        rounds[ident.peer_id] = ShardedRound(
            ident, header, digests, part, members, opened_at=0.0, wait_s=wait_s,
            cosign_s=cosign_s, grace_s=grace_s,
        )  # fmt: skip
    return rounds
