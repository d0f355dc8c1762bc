"""The shard fetch's pure decisions (docs/scale.md, Session 17): which of other groups' updates a
fetch round merges (`compose`, the same set at every member), a member's slice (`member_slice`)
and the pieces of an update's shards it is made of (`wanted_pieces`: on the chunk grid, exactly
the slice, session 27), their check (`slice_pieces_problem`), and an update known by its signed
headers as the merge sees it (`incoming_of_headers`); the members' state blocks, compared
before any slice is fetched (`state_blocks`, `states_problem`). No network, no clock.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from merge.group_chunks import aligned_bounds, overlaps
from merge.group_equivocation import GroupVariant
from merge.group_pipeline import GroupMerge, variant_of
from merge.group_update import GroupUpdate, signed_norm_bound
from merge.shard_round import STATE_SLACK, Incoming, part_gram

UpdateId = tuple[str, int]
"""(group key, seq): the id replicas apply a group update under."""
MAX_CANDIDATES = 64
"""Update ids one proposal may name (a fetch round merges at most this many)."""
MAX_HOLDERS = 4
"""Holders named per id in one proposal."""
MAX_STATES = 4
"""State tensors a replica holds at most (params, momentum, Delayed Nesterov's round sum)."""
StateBlock = tuple[float, ...]
"""The upper triangle, row by row, of the dot products among one slice of the state tensors."""


@dataclass(frozen=True)
class Proposal:
    """One member's signed word on a fetch round: the applied set its replica is on (count,
    digest) and the other groups' updates it was told of and has not applied, each with
    peers that hold it."""

    base: tuple[int, str]
    candidates: Mapping[UpdateId, tuple[str, ...]]
    states: tuple[StateBlock, ...] = ()
    """Its replica's state block over each member's slice, in member order (`state_blocks`):
    members whose replicas differ fall back before any slice is fetched (`states_problem`)."""
    states_sha: str = ""
    """Session 28: the SHA-256 (hex) of the state blocks a `propose` carried instead of them
    (merge.shard_states `states_digest`); "" once they are in hand (`resolved`). A proposal
    with it set is not decided on: its blocks are not known yet."""

    def problem(self) -> str | None:
        """Why a proposal is out of bounds, or None."""
        if len(self.candidates) > MAX_CANDIDATES:
            return "too_many_candidates"
        if any(not 0 < len(h) <= MAX_HOLDERS for h in self.candidates.values()):
            return "bad_holders"
        if len({len(b) for b in self.states}) > 1 or not all(map(_block_ok, self.states)):
            return "bad_states"
        if self.states_sha:
            return "states_unresolved"
        return None


def _block_ok(block: StateBlock) -> bool:
    size = _block_size(len(block))
    return size is not None and all(type(x) is float and math.isfinite(x) for x in block)


def _block_size(length: int) -> int | None:
    """k for a k x k upper triangle of `length` values (None: no such k <= MAX_STATES)."""
    sizes = {k * (k + 1) // 2: k for k in range(1, MAX_STATES + 1)}
    return sizes.get(length)


@dataclass(frozen=True)
class Composition:
    """The fetch round's set: the ids every member of the round proposed (sorted), who holds
    each, and the round's members: the largest class of proposers at one base and one state
    (the others fall back alone: `left_out`)."""

    base: tuple[int, str]
    ids: tuple[UpdateId, ...]
    holders: Mapping[UpdateId, tuple[str, ...]]
    members: tuple[str, ...] = ()


def compose(proposals: Mapping[str, Proposal], members: Sequence[str]) -> Composition | str:
    """The round's set from every member's proposal, or why the round falls back: a member's
    proposal missing or out of bounds, or no two members at one base and one state
    ("base_differs": no two at one base; else "state_differs": `states_problem`'s check,
    pairwise). The round runs
    among the largest class of members at one base whose state blocks agree (ties: the class
    of the first member in sorted order); a member outside it is left out (`left_out`) and
    falls back alone, nobody's fault: its replica applied other updates already, or one set
    in another order (session 17's 28 `base_differs` and 65 `gram_wrong_state` rounds each
    failed for every member). The ids are the intersection of the class's candidates (what
    one member was not told of waits for a later round), sorted; each id's holders the
    sorted union of those named. A pure function of the proposals: every member composes
    the same round whatever order they came in."""
    if set(proposals) != set(members) or not members:
        return "proposal_missing"
    if any(p.problem() is not None for p in proposals.values()):
        return "proposal_out_of_bounds"
    order = sorted(members)
    shape = states_problem([proposals[m].states for m in order], len(order), math.inf)
    if shape is not None:
        return shape
    best: list[str] = []
    for m in order:  # the first largest class wins ties: alike on every member
        cls = [n for n in order if _alike(proposals[m], proposals[n], len(order))]
        if len(cls) > len(best):
            best = cls
    if len(best) < 2 and len(order) > 1:  # "state_differs" when two shared a base
        shared = len({p.base for p in proposals.values()}) < len(order)
        return "state_differs" if shared else "base_differs"
    ordered, holders = agreed({m: proposals[m] for m in best})
    return Composition(proposals[best[0]].base, ordered, holders, tuple(best))


def left_out(composition: Composition, proposals: Mapping[str, Proposal], me: str) -> str | None:
    """Why `me` is not among the composed round's members ("left_out_base": its replica is
    on another applied set; "left_out_state": at one set, another state), or None."""
    if me in composition.members:
        return None
    return "left_out_base" if proposals[me].base != composition.base else "left_out_state"


def _alike(a: Proposal, b: Proposal, num_members: int) -> bool:
    return a.base == b.base and states_problem([a.states, b.states], num_members) is None


def agreed(
    proposals: Mapping[str, Proposal],
) -> tuple[tuple[UpdateId, ...], dict[UpdateId, tuple[str, ...]]]:
    """The ids every proposal names (sorted) and each one's holders (the sorted union of
    those named): a round's set, and what its members fall back on alike when it does not
    run (fetched whole and applied in this order)."""
    if not proposals:
        return (), {}
    ids = set.intersection(*(set(p.candidates) for p in proposals.values()))
    ordered = tuple(sorted(ids))
    holders = {
        uid: tuple(sorted({h for p in proposals.values() for h in p.candidates[uid]}))
        for uid in ordered
    }
    return ordered, holders


def state_gap(by_member: Sequence[tuple[StateBlock, ...]]) -> float | None:
    """The largest difference between two members' blocks over one slice, relative as
    `states_problem` weighs it (what its slack is compared with; None: no blocks, or blocks
    out of shape). For the `shard_round` event: how far a group's replicas lie apart."""
    if not by_member or not all(by_member) or len({len(b) for b in by_member}) != 1:
        return None
    if len({len(block) for blocks in by_member for block in blocks}) != 1:
        return None
    gaps = [_gap([blocks[i] for blocks in by_member]) for i in range(len(by_member[0]))]
    return max(gaps, default=0.0)


def state_blocks(states: Sequence[torch.Tensor], num_members: int) -> tuple[StateBlock, ...]:
    """The state block (`StateBlock`) of `states` (the replica's state tensors: merge.
    shard_round `state_tensors`) over each slice of a round of `num_members` members, in
    member order: what a member's part matrix will claim over its slice, as every member
    computes it from its own replica."""
    if not states:
        return ()
    blocks = []
    for start, end in aligned_bounds(states[0].numel(), num_members):
        gram = part_gram([t[start:end] for t in states])
        blocks.append(tuple(gram[i][j] for i in range(len(gram)) for j in range(i, len(gram))))
    return tuple(blocks)


def states_problem(
    by_member: Sequence[tuple[StateBlock, ...]], num_members: int, slack: float = STATE_SLACK
) -> str | None:
    """Why the members' replicas (each proposal's `state_blocks`, in member order) are not
    at one state, or None: every member's block over every slice must lie within `slack` of
    every other member's (relative to the larger norms of the two; merge.shard_round's part
    check, `part_problem`, takes no more). "state_differs" is nobody's fault: replicas of one
    applied set that applied it in other orders differ (Delayed Nesterov folds other
    batches into its momentum); a liar that proposes one state and sends another is caught
    by the part check. A pure function of the blocks: alike on every member. No blocks from
    anyone: no check (the part check still runs)."""
    if not any(by_member):
        return None
    if any(len(blocks) != num_members for blocks in by_member):
        return "proposal_out_of_bounds"
    if len({len(b) for blocks in by_member for b in blocks}) != 1:
        return "proposal_out_of_bounds"
    for index in range(num_members):
        slices = [blocks[index] for blocks in by_member]
        if not _blocks_agree(slices, slack):
            return "state_differs"
    return None


def _blocks_agree(blocks: Sequence[StateBlock], slack: float) -> bool:
    return _gap(blocks) <= slack


def _gap(blocks: Sequence[StateBlock]) -> float:
    """The largest spread of one entry among `blocks` (one slice's, one per member) over the
    product of the larger norms it joins: what `part_problem` compares with its slack."""
    size = _block_size(len(blocks[0]))
    assert size is not None
    diagonal = [k * size - k * (k - 1) // 2 for k in range(size)]  # (k, k) in the triangle
    worst, at = 0.0, 0
    for i in range(size):
        for j in range(i, size):
            values = [b[at] for b in blocks]
            norms = max(b[diagonal[i]] for b in blocks) * max(b[diagonal[j]] for b in blocks)
            spread = max(values) - min(values)
            scale = math.sqrt(max(norms, 0.0))
            if spread > 0:
                worst = max(worst, spread / scale if scale > 0 else math.inf)
            at += 1
    return worst


def member_slice(numel: int, members: Sequence[str], me: str) -> tuple[int, int]:
    """[start, end) of the model `me` holds in a fetch round of `members` (its rank in the
    sorted list; on the chunk grid: merge.group_chunks `aligned_bounds`)."""
    ordered = sorted(set(members))
    return aligned_bounds(numel, len(ordered))[ordered.index(me)]


def wanted_pieces(num_shards: int, numel: int, start: int, end: int) -> list[tuple[int, int, int]]:
    """(shard, a, b): what [start, end) holds of each shard of an update split into
    `num_shards` on the chunk grid; a member fetches exactly these values, each piece with
    its shard's chunk digests (session 27: no shard whole)."""
    return overlaps(aligned_bounds(numel, num_shards), start, end)


SlicePieces = Mapping[int, tuple[tuple[str, ...], torch.Tensor]]
"""A slice answer's pieces by shard: the shard's chunk digests and what the slice holds of it."""


def slice_pieces_problem(
    update: GroupUpdate, pieces: SlicePieces, numel: int, start: int, end: int
) -> str | None:
    """Why pieces fetched of `update` (its headers checked: `GroupUpdate.header_problem`) are
    not exactly [start, end) of what its reducers co-signed, or None: one per shard the
    range meets (`wanted_pieces`), each of its size, fp32, its chunks those of the shard's
    co-signed root (`GroupUpdate.slice_problem`)."""
    wanted = wanted_pieces(update.num_shards, numel, start, end)
    if set(pieces) != {k for k, _, _ in wanted}:
        return "shards_missing" if set(pieces) < {k for k, _, _ in wanted} else "shard_index"
    for k, a, b in wanted:
        digests, piece = pieces[k]
        if piece.dtype != torch.float32 or piece.shape != (b - a,):
            return "shard_size"
        problem = update.slice_problem(k, digests, a, piece, numel)
        if problem is not None:
            return problem
    return None


def joined_slice(pieces: SlicePieces) -> torch.Tensor:
    """The slice the checked pieces make, in shard order."""
    ordered = [pieces[k][1] for k in sorted(pieces)]
    return torch.cat(ordered) if ordered else torch.zeros(0)


def variant_digest(update: GroupUpdate) -> str:
    """What tells two variants of one id apart (shard digests, included members), hashed:
    members holding other variants of one id must not decide one round."""
    digests, included = variant_of(update)
    return hashlib.sha256("\n".join([*digests, "|", *included]).encode()).hexdigest()


def incoming_of_headers(
    merge: GroupMerge, update: GroupUpdate, numel: int, in_group: Callable[[str], bool]
) -> Incoming:
    """An update known by its signed headers (its aggregate not at hand) as the merge sees it:
    the refusal its headers earn (`GroupMerge._problem`'s, but for the aggregate's own
    checks, which are the fetched shards': `pieces_problem`), its header sized `numel`."""
    p = merge.pipeline
    problem = update.header_problem(in_group)
    if problem is None and p.replica.layout is not None:
        problem = "wrong_size"
    if problem is None and p.run_id not in (None, update.head.run_id):
        problem = "wrong_run"
    header = update.update_header(p.fingerprint, p.config.max_inner_steps)
    root = hashlib.sha256("".join(update.shard_digests).encode()).hexdigest()
    header = replace(header, numel=numel, payload_sha256=root)
    return Incoming(
        header,
        update.head.learners,
        None if problem is None else f"group_{problem}",
        variant_of(update),
        update.reducers() if problem is None else (),
        None,
        signed_norm_bound(update, merge.reduction) if problem is None else float("inf"),
        GroupVariant.of(update) if problem is None else None,
    )
