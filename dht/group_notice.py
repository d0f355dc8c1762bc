"""Signed `group-done` notices and what one may make this node want; pure (dht/group_exchange.py
does the network). Session 14 (docs/scale.md, "Session 14: slow reducers, signed notices").

A member that completed a group round tells the other members and its share of the peers
outside the group (`group-done`). Until session 14 that notice was an unsigned hint: anyone
could name any round of any group, and a receiver outside the group handed the id to the
gossip's catch-up, which wanted it from the notifier and counted it lost when nobody served it
(up to 64 rounds past the highest known). Now:

- **Signed** (`DGD2`; `DGD3` since session 28, below): the notifier signs (run id, group key,
  epoch, round, included set) with its node identity (Ed25519, `merge.identity`), as every
  header in merge/ is signed. A
  receiver checks the signature against the sender's peer id; an unsigned notice (`DGD1`, a
  node of session 13 or older) is refused and counted (`group_done_unsigned`): the two
  versions do not exchange notices (the update is still found by repair, as for a missed
  notice).
- **Bounded** (`notice_refusal`): the signer is the stream's sender, inside the group's prefix,
  in the round's included set and, when this node knows the epoch's member list of that group
  (it ran a round of it), in that list; and the round is at most one past the highest round
  this node has evidence of other than notices: its own rounds, verified parts and pieces
  (groups count rounds alike), and that group's updates its replica applied (groups drift
  apart: session 14's run had one group 10 rounds ahead of the other, whose notices the
  bound without the replica refused 102 times). A notice never raises that bound, so a
  member cannot walk it up one notice at a time; an update its group co-signed does. What a
  notice can make a peer want is then one id of a round its group may really have
  completed; what is fetched is checked as every update is.
- **Naming its variant** (session 26, `variant`: merge.group_equivocation.variant_digest):
  a receiver that holds another variant of the round fetches this one from the notifier
  once, so the two meet and the proof forms (dht.variant_fetches). The digest travels beside
  the signed statement, not in it: a node of session 25 still verifies a new notice (and
  ignores the field), and a notice without it still parses. It is the sender's word all the
  same (the signer must be the stream's sender, whose peer id the transport authenticates),
  and the worst a false one does is one bounded fetch from that sender, counted.
- **Versioned** (session 28, `DGD3`): since session 27 a variant's digest hashes chunk roots
  (merge.group_chunks), where session 26's hashed shard digests of the values, so the same
  round named by an old node names another variant here, and the update it leads to is
  refused as `shard_mismatch` (dht.grouping_wire). A node sends `DGD3`, whose signed
  statement carries the version (`diloco-group-done/3`: a `DGD2` notice relabelled `DGD3`
  fails its signature); a `DGD2` notice (sessions 14-27: session 27's cannot be told from
  session 26's) is refused as "old_version" (counted `group_done_old_version`), `DGD1` as
  "unsigned". Nothing is lost by the refusal that a missed notice does not lose: the update
  is still found by repair (dht.gossip_groups).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass

from dht.grouping_done import Done as Done
from dht.grouping_wire import MAX_COUNT, MAX_MEMBERS, MAX_TEXT, GroupMessageError, names_a_round
from dht.variant_fetches import is_digest
from merge.group_update import SIGNATURE_BYTES
from merge.identity import Identity, verify_signature

NOTICE_MAGIC = b"DGD3"
OLD_MAGIC = b"DGD2"
"""Sessions 14-27's signed notice: refused as "old_version"."""
UNSIGNED_MAGIC = b"DGD1"
_DOMAIN = b"diloco-group-done/3\n"
ROUNDS_AHEAD = 1
"""How far past the highest group round this node knows of a notice may name a round."""


@dataclass(frozen=True)
class SignedDone:
    """A group-done notice with its notifier's signature (see the module's docstring)."""

    run_id: str
    done: Done
    signer: str
    signature: bytes

    @classmethod
    def of(cls, done: Done, identity: Identity, run_id: str) -> SignedDone:
        return cls(run_id, done, identity.peer_id, identity.sign(statement(run_id, done)))

    def verified(self) -> bool:
        return verify_signature(self.signer, statement(self.run_id, self.done), self.signature)

    def to_bytes(self) -> bytes:
        d = self.done
        fields = {
            "run_id": self.run_id,
            "group_key": d.group_key,
            "epoch": d.epoch,
            "round": d.round,
            "included": list(d.included),
            "signer": self.signer,
            "signature": self.signature.hex(),
        }
        if d.variant is not None:  # outside the signed statement (see the module's docstring)
            fields["variant"] = d.variant
        return NOTICE_MAGIC + json.dumps(fields, separators=(",", ":")).encode()


def statement(run_id: str, done: Done) -> bytes:
    """What a notifier signs: the run, the round and its included set."""
    fields = [run_id, done.group_key, done.epoch, done.round, list(done.included)]
    return _DOMAIN + json.dumps(fields, separators=(",", ":")).encode()


def notice_max_bytes() -> int:
    return len(NOTICE_MAGIC) + 512 + MAX_TEXT * 2 + MAX_MEMBERS * (MAX_TEXT + 4)


def decode_notice(blob: object) -> SignedDone:
    """An untrusted `group-done` blob's fields (not its signature: `notice_refusal` checks
    that after the cheap checks); GroupMessageError ("unsigned", "old_version", "malformed")
    otherwise."""
    if isinstance(blob, bytes) and blob[:4] == UNSIGNED_MAGIC:
        raise GroupMessageError("unsigned", "an unsigned group-done notice (session 13 or older)")
    if isinstance(blob, bytes) and blob[:4] == OLD_MAGIC:
        raise GroupMessageError("old_version", "a group-done notice of session 27 or older")
    if not isinstance(blob, bytes) or blob[:4] != NOTICE_MAGIC:
        raise GroupMessageError("malformed", "not a group-done notice")
    try:
        f = json.loads(blob[4:])
        included = f["included"]
        variant = f.get("variant")  # absent in a notice of session 25 or older
        done = Done(f["group_key"], f["epoch"], f["round"], tuple(included), variant)
        notice = SignedDone(f["run_id"], done, f["signer"], bytes.fromhex(f["signature"]))
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
        raise GroupMessageError("malformed", "a group-done notice that does not parse") from None
    ok = (
        names_a_round(done.group_key, included)
        and all(type(v) is int and 0 <= v < MAX_COUNT for v in (done.epoch, done.round))
        and all(_text(v) for v in (notice.run_id, notice.signer))
        and len(notice.signature) == SIGNATURE_BYTES
        and (variant is None or is_digest(variant))
    )
    if not ok:
        raise GroupMessageError("malformed", "a group-done notice with fields out of range")
    return notice


def _text(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_TEXT


def notice_refusal(
    notice: SignedDone,
    sender: str,
    run_id: str,
    *,
    in_group: Callable[[str], bool],
    members: Collection[str] | None,
    highest_round: int,
) -> str | None:
    """Why this node refuses a verified-to-parse notice from `sender`, or None to act on it.

    `in_group`: whether a peer id is inside the notice's group prefix (dht.grouping
    member_check); `members`: the epoch's member list of that group when this node knows it
    (it ran a round of it), else None; `highest_round`: the highest group round this node has
    evidence of other than notices (-1: none)."""
    done = notice.done
    if notice.run_id != run_id:
        return "wrong_run"
    if notice.signer != sender:
        return "wrong_sender"
    if not in_group(sender) or sender not in done.included:
        return "not_a_member"
    if members is not None and sender not in members:
        return "not_listed"
    if done.round > highest_round + ROUNDS_AHEAD:
        return "too_far"
    if not notice.verified():
        return "bad_signature"
    return None
