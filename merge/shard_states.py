"""A fetch round's state blocks sent as a digest (docs/scale.md, Session 28: blocks28); pure.

Every member's `propose` used to carry its replica's state block over every member's slice
(merge.shard_fetch `state_blocks`): g blocks each, g - 1 proposals in: g^2 blocks a member.
`compose` compares every pair of members over every slice, so each member needs every
block it compares; but two replicas at one state compute the same blocks bit for bit, and
the usual round's members are at one state. So a proposal carries the SHA-256 of its blocks
(`states_digest`); a member whose digest equals the receiver's has exactly the receiver's
blocks (`resolved` takes the receiver's own), and only members whose digests differ send
each other their blocks in full (a `states` message: `states_wanted`, alike on both sides:
each of two members sends its blocks to the other exactly when their digests differ). The
proposals `resolved` gives are the ones the full form carried, bit for bit, so `compose`
decides exactly as it did (tests/unit/test_shard_states.py).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import replace

from merge.shard_fetch import Proposal, StateBlock

_DOMAIN = b"diloco-state-blocks/1\n"


def states_digest(states: Sequence[StateBlock]) -> str:
    """The SHA-256 (hex) of state blocks: their count, each one's length and values as
    little-endian float64, so two lists of blocks share a digest only when equal bit for bit
    (-0.0 and 0.0 differ: `_gap` treats them alike, and then the blocks are sent)."""
    digest = hashlib.sha256(_DOMAIN + struct.pack("<I", len(states)))
    for block in states:
        digest.update(struct.pack(f"<I{len(block)}d", len(block), *block))
    return digest.hexdigest()


def states_wanted(proposals: Mapping[str, Proposal], me: str) -> list[str]:
    """The members whose blocks `me` needs in full and who need its blocks (sorted): those
    whose proposal carried a digest (`Proposal.states_sha`) other than `me`'s own blocks'."""
    own = states_digest(proposals[me].states)
    return sorted(s for s, p in proposals.items() if s != me and p.states_sha not in ("", own))


def resolved(
    proposals: Mapping[str, Proposal], me: str, sent: Mapping[str, Sequence[StateBlock]]
) -> tuple[dict[str, Proposal], list[str]]:
    """Each proposal with its state blocks in hand, and the senders whose `states` message did
    not match the digest their proposal signed (their proposal stays unresolved, so `compose`
    finds it out of bounds). A digest equal to `me`'s own blocks' stands for them; another is
    taken from `sent` (the members' `states` messages, `states_wanted`)."""
    own = proposals[me].states
    digest = states_digest(own)
    out: dict[str, Proposal] = {}
    wrong: list[str] = []
    for sender, proposal in proposals.items():
        if proposal.states_sha == "":
            out[sender] = proposal
        elif proposal.states_sha == digest:
            out[sender] = replace(proposal, states=own, states_sha="")
        elif sender in sent and states_digest(sent[sender]) == proposal.states_sha:
            out[sender] = replace(proposal, states=tuple(sent[sender]), states_sha="")
        else:
            out[sender] = proposal
            wrong.append(sender)
    return out, sorted(wrong)
