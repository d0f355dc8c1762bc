"""The shard fetch's messages on the wire (docs/scale.md, Session 17); pure: dht/
group_exchange_fetch.py does the network.

`group-fetch` carries a fetch round's three messages between the round's members, each
signed by its sender's node identity (Ed25519, merge.identity) over (run, group key, epoch,
round, kind, body, the tensors' SHA-256), checked against the stream's sender:

- `propose`: the sender's applied count and digest, its candidates (other groups'
  updates it was told of, each with at most 2 holders, named once in a holder table) and the
  SHA-256 of its state blocks over the members' slices (session 28; the blocks themselves
  in raw float64 in sessions 18-27): merge.shard_fetch `Proposal`, body
  dht.shard_fetch_bodies';
- `states` (session 28): the sender's state blocks in full, sent only to the members whose
  proposal's digest differs from its own (merge.shard_states `states_wanted`); taken only
  when they hash to the digest the sender's proposal signed;
- `part`: the upper triangle of its part Gram matrix (merge.shard_member `MemberRound.part`)
  in float32 values as the message's one tensor and, in the signed body, the SHA-256 of the
  round's variant digests (`variant_digest` of each fetched update, in id order; session 29:
  merge.shard_part); the receiver mirrors the triangle back to the sender's matrix bit for
  bit (dht.shard_fetch_bodies). Sessions 26-28's parts (float64 in the body, one digest per
  update) are refused as "old_version";
- `sums`: its slices of the plan's weighted sums (fp32: session 24; bf16 in sessions 20-23),
  one per sum, at most `MAX_SUMS` (merge.shard_round_sums): one when the round stops at its
  first Delayed Nesterov fold (sessions 18-26), two or three since session 27, when a round
  decides past its folds (second27). A `sums` message with more tensors does not decode
  (`group_fetch_malformed`); one with another count than the round's plan fails
  `sums_problem` ("sums_shape": `group_fetch_sums_refused`), both counted against the sender.
  Both releases frame `sums` alike; a session 26 node refuses a session 27 part (below), so
  the two never reach the sums of one round;
- `abort`: the sender fell back (its reason): the others stop waiting for it (session 18).

`group-slice` (`DSS2`, session 27) asks a holder for a range of an update on the chunk grid
(merge.group_chunks): the answer is the update's fields (headers, digests, co-signatures:
dht.grouping_wire `update_meta`), exactly that range, one piece per shard it meets, and each
such shard's chunk digests (their root is what its reducer co-signed). A session 26 peer's
request (no version) or answer (`DSS1`: whole shards) is refused as "old_version".
A message's tensors travel in bf16 when every value of every one of them is a bf16 value (a
group update's aggregate of bf16 parts: exact, half the bytes), else in fp32 (`codec` in the
framing; signatures cover the fp32 values either way).
Everything is read within a bound before it is parsed; what does not parse is a
GroupMessageError (its reason counted against the sender by the caller).

Versions: since session 27 a node sends the compact `propose` and `part` bodies and still
reads session 26's JSON bodies (the full Gram matrix and state blocks as JSON floats, holders
inline), told apart by their keys; a session 26 node reading a compact part finds no "gram"
and refuses it (its round falls back to the whole fetch). Since session 28 a node sends the
digest `propose` and still reads the session 27 and 26 forms (their blocks in full: no
`states` message is sent to or waited for from such a sender); a session 27 node finds no
"states" in a session 28 proposal and refuses it (`group_fetch_malformed`: its round falls
back), and refuses the `states` kind. Since session 29 a part carries its triangle as a
float32 tensor and one digest of the variant list (`{"v": 3, ...}`); older parts are
"old_version" here, and a session 28 node finds no "upper" in a session 29 part and refuses
it (`group_fetch_malformed`): a mixed group's fetch rounds fall back to the whole fetch. The
framing, the signed statement and the `sums`/`abort` bodies are those of session 26.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

import torch

from dht.grouping_shards import shard_codec
from dht.grouping_wire import (
    MAX_COUNT,
    MAX_MEMBERS,
    MAX_TEXT,
    GroupMessageError,
    RoundId,
    update_meta,
    update_of_meta,
)
from dht.shard_fetch_bodies import MAX_TRIANGLE, part_of_message, proposal_of_body, states_of_body
from dht.shard_fetch_bodies import part_message as part_message
from dht.shard_fetch_bodies import proposal_body as proposal_body
from dht.shard_fetch_bodies import states_body as states_body
from merge.codecs import get_codec
from merge.group_chunks import chunk_digests, num_chunks, on_grid
from merge.group_update import SIGNATURE_BYTES, GroupUpdate
from merge.identity import Identity, verify_signature
from merge.shard_fetch import Proposal, SlicePieces, StateBlock, UpdateId, wanted_pieces
from merge.shard_round_sums import MAX_SUMS as MAX_SUMS  # what a `sums` message carries at most

FETCH_MAGIC = b"DSF1"
SLICE_MAGIC = b"DSS2"
_DOMAIN = b"diloco-group-fetch/1\n"
KINDS = ("propose", "states", "part", "sums", "abort")
MAX_META_BYTES = 1 << 20
"""A message's JSON: a proposal's 64 ids with holders, a part's (3 + 64)^2 floats."""
WIDTHS = {"fp32": 4, "bf16": 2}
"""Bytes per value of the codecs a message's tensors travel in."""


@dataclass(frozen=True)
class FetchMessage:
    """One signed `group-fetch` message (see the module's docstring)."""

    run_id: str
    round_id: RoundId
    kind: str
    sender: str
    body: dict[str, Any]
    tensors: tuple[torch.Tensor, ...]
    signature: bytes = b""

    def statement(self) -> bytes:
        key, epoch, round_ = self.round_id
        fields = [self.run_id, key, epoch, round_, self.kind, self.sender, self.body]
        tail = hashlib.sha256(_tail(self.tensors)).hexdigest()
        return _DOMAIN + json.dumps([*fields, tail], sort_keys=True).encode()

    def signed(self, identity: Identity) -> FetchMessage:
        return FetchMessage(
            self.run_id, self.round_id, self.kind, identity.peer_id, self.body, self.tensors,
            identity.sign(self.statement()),
        )  # fmt: skip

    def verified(self) -> bool:
        return verify_signature(self.sender, self.statement(), self.signature)

    def to_bytes(self) -> bytes:
        key, epoch, round_ = self.round_id
        meta = {
            "run": self.run_id, "key": key, "epoch": epoch, "round": round_, "kind": self.kind,
            "sender": self.sender, "body": self.body, "signature": self.signature.hex(),
            "sizes": [t.numel() for t in self.tensors],
        }  # fmt: skip
        codec, tail = _coded(self.tensors)
        raw = json.dumps({**meta, "codec": codec}, separators=(",", ":")).encode()
        return FETCH_MAGIC + struct.pack(">I", len(raw)) + raw + tail


def _tail(tensors: tuple[torch.Tensor, ...]) -> bytes:
    """The tensors' fp32 bytes: what a signature covers, whatever codec they travel in."""
    return b"".join(_fp32(t).numpy().astype("<f4").tobytes() for t in tensors)


def _fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to(torch.float32).contiguous()


def _coded(tensors: tuple[torch.Tensor, ...]) -> tuple[str, bytes]:
    """The codec the tensors travel in and their bytes: bf16 when it holds every value
    exactly (half the bytes), else fp32."""
    flat = [_fp32(t).reshape(-1) for t in tensors]
    if all(shard_codec(t) == "bf16" for t in flat):
        return "bf16", b"".join(get_codec("bf16").encode(t) for t in flat)
    return "fp32", b"".join(get_codec("fp32").encode(t) for t in flat)


def fetch_max_bytes(numel: int) -> int:
    return len(FETCH_MAGIC) + 4 + MAX_META_BYTES + 4 * max(MAX_SUMS * numel, MAX_TRIANGLE)


def _framed(blob: object, magic: bytes, limit: int, what: str) -> tuple[Any, bytes]:
    if not isinstance(blob, bytes) or len(blob) < 8 or blob[:4] != magic:
        raise GroupMessageError("malformed", f"not a {what}")
    (length,) = struct.unpack(">I", blob[4:8])
    if length > limit or len(blob) < 8 + length:
        raise GroupMessageError("malformed", f"a {what} cut short or too long")
    try:
        meta = json.loads(blob[8 : 8 + length], parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise GroupMessageError("malformed", f"a {what} that does not parse") from None
    if not isinstance(meta, dict):
        raise GroupMessageError("malformed", f"a {what} that is not an object")
    return meta, blob[8 + length :]


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number here")


def _fp32s(
    tail: bytes, sizes: object, numel: int, most: int, codec: object = "fp32"
) -> tuple[torch.Tensor, ...]:
    """The fp32 tensors of `sizes` values each, cut from `tail` in `codec` (fp32 or bf16;
    finite, at most `most` of them, none longer than `numel`)."""
    if not isinstance(codec, str) or codec not in WIDTHS:
        raise GroupMessageError("malformed", "tensors in a codec other than fp32 or bf16")
    if not isinstance(sizes, list) or len(sizes) > most:
        raise GroupMessageError("malformed", "tensor sizes out of range")
    if not all(type(n) is int and 0 <= n <= numel for n in sizes):
        raise GroupMessageError("malformed", "tensor sizes out of range")
    if len(tail) != WIDTHS[codec] * sum(sizes):
        raise GroupMessageError("wrong_size", "tensor bytes do not match their sizes")
    values = get_codec(codec).decode(tail, sum(sizes))
    if not bool(torch.isfinite(values).all()):
        raise GroupMessageError("not_finite", "a fetch message holds NaN or infinity")
    return tuple(torch.split(values, sizes)) if sizes else ()


def decode_fetch(blob: object, numel: int) -> FetchMessage:
    """An untrusted `group-fetch` message's fields (its signature checked by `verified`)."""
    meta, tail = _framed(blob, FETCH_MAGIC, MAX_META_BYTES, "fetch message")
    try:
        run, key, epoch, round_ = meta["run"], meta["key"], meta["epoch"], meta["round"]
        kind, sender, body = meta["kind"], meta["sender"], meta["body"]
        signature = bytes.fromhex(meta["signature"])
    except (KeyError, TypeError, ValueError):
        raise GroupMessageError("malformed", "a fetch message's fields") from None
    texts = (run, key, sender)
    if not all(isinstance(t, str) and 0 < len(t) <= MAX_TEXT for t in texts):
        raise GroupMessageError("malformed", "a fetch message's names out of range")
    if not all(type(v) is int and 0 <= v <= MAX_COUNT for v in (epoch, round_)):
        raise GroupMessageError("malformed", "a fetch message's round out of range")
    if kind not in KINDS or not isinstance(body, dict) or len(signature) != SIGNATURE_BYTES:
        raise GroupMessageError("malformed", "a fetch message's kind, body or signature")
    most, longest = {"sums": (MAX_SUMS, numel), "part": (1, MAX_TRIANGLE)}.get(kind, (0, 0))
    tensors = _fp32s(tail, meta.get("sizes"), longest, most, meta.get("codec", "fp32"))
    return FetchMessage(run, (key, epoch, round_), kind, sender, body, tensors, signature)


# ---- bodies (dht.shard_fetch_bodies: their compact and session 26 forms) -------------------


def proposal_of(message: FetchMessage) -> Proposal:
    """A `propose` message's proposal, within bounds (GroupMessageError otherwise)."""
    return proposal_of_body(message.body)


def states_of(message: FetchMessage) -> tuple[StateBlock, ...]:
    """A `states` message's blocks (session 28), within bounds (GroupMessageError otherwise)."""
    return states_of_body(message.body)


def part_of(message: FetchMessage) -> tuple[object, str]:
    """A `part` message's Gram matrix (checked by `MemberRound.part_from`) and the SHA-256 of
    its sender's variant list (merge.shard_part `variants_digest`)."""
    return part_of_message(message.body, message.tensors)


# ---- group-slice ----------------------------------------------------------------------------

OLD_SLICE_MAGIC = b"DSS1"
"""A session 26 answer (whole shards, their digests SHA-256 of their values): refused."""
SLICE_VERSION = 2
"""The request's version: 2 since session 27 (exact slices on the chunk grid, chunk roots)."""
_HEX_DIGEST = 64


def slice_request(uid: UpdateId, start: int, end: int) -> bytes:
    fields = {"key": uid[0], "seq": uid[1], "start": start, "end": end, "v": SLICE_VERSION}
    return json.dumps(fields).encode()


def parse_slice_request(blob: bytes, numel: int) -> tuple[UpdateId, int, int]:
    """A peer's ask for [start, end) of an update it names (GroupMessageError when out of
    bounds; "old_version" from a session 26 peer, whose request has no version): answered
    with exactly that range, which must lie on the chunk grid (merge.group_chunks)."""
    try:
        fields = json.loads(blob, parse_constant=_no_constant)
        key, seq, start, end = fields["key"], fields["seq"], fields["start"], fields["end"]
    except (ValueError, RecursionError, KeyError, TypeError):
        raise GroupMessageError("malformed", "a slice request") from None
    if fields.get("v") != SLICE_VERSION:
        raise GroupMessageError("old_version", "a slice request of another version")
    if not _text(key) or type(seq) is not int or not 1 <= seq <= MAX_COUNT:
        raise GroupMessageError("malformed", "a slice request's id")
    if not (type(start) is int and type(end) is int and 0 <= start <= end <= numel):
        raise GroupMessageError("malformed", "a slice request's range")
    if not (on_grid(numel, start) and on_grid(numel, end)):
        raise GroupMessageError("malformed", "a slice request off the chunk grid")
    return (key, seq), start, end


def slice_answer(update: GroupUpdate, start: int, end: int) -> bytes:
    """The update's fields and exactly [start, end) of it, one piece per shard the range
    meets, each with its shard's chunk digests (whose root its reducer co-signed); bf16 when
    the pieces hold bf16 values, as a group update of bf16 parts does."""
    numel = update.aggregate.numel()
    wanted = wanted_pieces(update.num_shards, numel, start, end)
    bounds = update.shard_bounds(numel)
    pieces = tuple(update.aggregate[a:b] for _, a, b in wanted)
    digests = [
        list(chunk_digests(update.aggregate[bounds[k][0] : bounds[k][1]], numel, bounds[k][0]))
        for k, _, _ in wanted
    ]
    codec, tail = _coded(pieces)
    meta = {
        "update": update_meta(update),
        "shards": [k for k, _, _ in wanted],
        "sizes": [p.numel() for p in pieces],
        "digests": digests,
        "codec": codec,
    }
    raw = json.dumps(meta, separators=(",", ":")).encode()
    return SLICE_MAGIC + struct.pack(">I", len(raw)) + raw + tail


def slice_meta_bytes(numel: int) -> int:
    """The most JSON a slice answer may hold: the update's fields, and at most one chunk
    digest per chunk of the model (quoted, with a comma) plus each list's brackets."""
    return MAX_META_BYTES + num_chunks(numel) * (_HEX_DIGEST + 3) + MAX_MEMBERS * 3


def slice_max_bytes(numel: int) -> int:
    return len(SLICE_MAGIC) + 4 + slice_meta_bytes(numel) + 4 * numel


def decode_slice(blob: object, numel: int) -> tuple[GroupUpdate, SlicePieces]:
    """An untrusted answer: the update's fields (its aggregate empty) and its pieces by shard,
    each with the shard's chunk digests (checked by the caller against the co-signed roots:
    merge.shard_fetch `slice_pieces_problem`). A session 26 answer is "old_version"."""
    if isinstance(blob, bytes) and blob[:4] == OLD_SLICE_MAGIC:
        raise GroupMessageError("old_version", "a session 26 slice answer (whole shards)")
    meta, tail = _framed(blob, SLICE_MAGIC, slice_meta_bytes(numel), "slice answer")
    shards, fields, digests = meta.get("shards"), meta.get("update"), meta.get("digests")
    if not isinstance(shards, list) or not all(type(k) is int for k in shards):
        raise GroupMessageError("malformed", "a slice answer's shards")
    if not isinstance(digests, list) or len(digests) != len(shards):
        raise GroupMessageError("malformed", "a slice answer's chunk digests")
    if sum(len(d) for d in digests if isinstance(d, list)) > num_chunks(numel):
        raise GroupMessageError("malformed", "a slice answer's chunk digests")
    if not all(isinstance(d, list) and all(map(_hex_digest, d)) for d in digests):
        raise GroupMessageError("malformed", "a slice answer's chunk digests")
    pieces = _fp32s(tail, meta.get("sizes"), numel, MAX_MEMBERS, meta.get("codec", "fp32"))
    if len(pieces) != len(shards) or len(set(shards)) != len(shards):
        raise GroupMessageError("malformed", "a slice answer's shards")
    update = update_of_meta(json.dumps(fields).encode(), torch.empty(0))
    chunks = (tuple(d) for d in digests)
    return update, dict(zip(shards, zip(chunks, pieces, strict=True), strict=True))


def _hex_digest(value: object) -> bool:
    return isinstance(value, str) and len(value) == _HEX_DIGEST


def _text(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_TEXT
