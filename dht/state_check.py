"""A newcomer checks the state a donor served against what the other live peers report.

The donor is chosen by its own claim of progress, so its state is checked before it replaces
the replica, against signed heartbeats of other peers:

- the donor's own highest applied seq may not exceed what its own signed heartbeat says it
  published by more than `max_own_lead` (+1 for an update in flight): a donor that
  contradicts itself is not believed. The lead is for heartbeats that lag under load (at
  bench.scale --sizes 16 on 2 cores, heartbeats came up to 20 s late, ~14 rounds of
  `tiny`, and three honest gap donors were refused for their own update 5-7 above it: the
  replica that asked stayed 4 updates short to the end, its attempts spent). Own seqs
  within the lead are reported as unannounced like another author's: what a donor gains
  by fabricating ids of its own is no more than by withholding those updates;
- another author's seqs above what that author's heartbeat announced are *unannounced*: the
  state is accepted with them and they are reported (StateVerdict). Refusing such a state
  would hand a veto to one lying peer: an adversary that signs updates outside its heartbeat
  under-reports its own latest seq, and then every honest donor, holding those validly
  signed and validated updates, would be refused (a newcomer refused both honest donors and
  started from the untrained model). Nor are those ids trimmed from the loaded applied set:
  the donor's parameters already hold those updates, and a trimmed id would be fetched and
  applied a second time. What a poisoning donor gains by fabricating ids of a live author is
  no more than it gains by fabricating ids of an author that is not live (never checkable):
  ids are an explicit set, never a high-water mark (no "seq <= last applied" rule), so an
  author's real later updates are still applied when they arrive; the fabricated ids keep
  the newcomer's digest apart from the honest ones, which is visible;
- when other peers report the same applied set (digest), the point the state's parameters
  settle to once its outer momentum has played out must match their sketch of that point
  (drift below `max_drift`; it does not depend on the order updates were applied in), or,
  where two or more of them report it and sit apart from each other, lie no farther from
  them than they lie from each other (`same_digest_spread`: the record-weighted median
  over them of each one's weighted median distance to the others): a poisoned model behind
  an honest applied set is refused, and so is a momentum that would still move the params
  by more than `max_rest` of their norm (an offset hidden there). Why the spread: at 16
  nodes, replicas with one applied set weigh up to 80 % of its updates differently (the
  contribution budget, the learner floor, robust verdicts) and sit 0.5-1.7 of the params'
  norm apart; the settle's donor (dht.realign_settle.settle_donor, their weighted medoid)
  then lies within `max_drift` of nobody, every replica refused it, nobody ever sat at it,
  and the settle never completed (bench.scale --sizes 16 ended 1.2 apart, 12 bad_state).
  What a poisoner behind an honest applied set can plant is bounded by the disagreement
  the honest replicas there already show, never more: a donor at least as central as the
  typical honest replica. In a swarm whose replicas agree (every test and bench.attack:
  a few per cent apart) that is the old bound; where they sit 1.0 apart, a distance of 1.0
  tells no poison from honest weighting, whatever the check;
- whatever the applied sets (a swarm still training rarely agrees at one instant, and a
  poisoning donor can fabricate ids to stand alone, or have a second key report its applied
  set and sketch), the settled point must lie within `max_distance` of the sketches of at
  least half the other live peers that have applied anything (the lower median of the
  distances; where peers at the state's applied set sit farther apart than `max_distance`,
  that spread is the bound): replicas a few updates apart differ by a few percent of the
  params' norm, a model noised or swapped for another by far more. One accomplice heartbeat
  then vouches for a poisoned state only where the honest trained peers are no more than it
  (two or fewer others); one lying heartbeat never vetoes an honest state. Votes weigh by
  applied track record (dht.vouchers): a key none of whose updates the other peers report
  applied, or that the checked state holds, has no vote, so a flood of fresh keys vouching for
  a poisoned state outvotes no established author (only in a swarm where nobody has a record
  yet do keys count one each). This bounds what a donor can plant; it does not prove the state
  honest (a donor may serve a model a few rounds off; open swarms cannot tell keys from
  people; `--allow-keys` can).

A refusal is counted as `bad_state` against the donor and the next donor is tried; the error
names the check that refused and the distances it measured (the `realign_refused` event).
Pure: no network, no clock (dht.state_transfer reads the heartbeats and loads the state).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from dht.heartbeat import Heartbeat
from dht.vouchers import Reports, voucher_weights, weighted_lower_median
from merge.cosign_ledger import parse_cosigned
from merge.replica_state import parse_applied
from merge.sketch import StateSketch, relative_distance

MAX_DRIFT = 0.05
"""Replicas with one applied set settle to one point (merge.sketch): honest ones differ from it
by rounding and by the few robust verdicts taken near a threshold, far below this."""
MAX_REST = 3.0
"""How far, relative to the params' norm, a state's momentum may still move its params: an
honest replica's momentum tail is a fraction of that (Nesterov 0.9 at lr 0.7 keeps the params
~8 rounds of movement behind their settled point); a donor that offset its params and hid the
offset in the momentum, so that the settled point looks honest, is refused."""


MAX_OWN_LEAD = 16
"""How many of its own updates a donor's state may hold beyond its heartbeat's latest seq + 1:
heartbeats lag under load (20 s measured at 16 nodes on 2 cores, ~14 rounds of `tiny`)."""
MAX_DISTANCE = 0.5
"""How far, relative to its norm, a state's settled point may lie from the sketches of half
the other trained live peers: honest replicas a few rounds apart differ by a
few percent; bench.attack's poisoned donor adds noise of the params' own norm (distance ~1)."""


MAX_SPREAD_VOTERS = 32
"""Same-digest peers whose mutual distances make the spread (the heaviest records first):
bounds its work to O(32^2) sketch distances however many peers report the digest."""


class StateCheckError(ValueError):
    """A donor's state that the other live peers' heartbeats contradict: `check` names the
    check that refused it, `distances` what that check measured (for the event log)."""

    def __init__(
        self, message: str, *, check: str = "state", distances: Mapping[str, float] | None = None
    ) -> None:
        super().__init__(message)
        self.check = check
        self.distances = {k: round(v, 6) for k, v in (distances or {}).items()}


@dataclass(frozen=True)
class StateVerdict:
    """A donor's state the newcomer accepts, and what in it no heartbeat vouches for."""

    unannounced: dict[str, list[int]] = field(default_factory=dict)
    """Per author, the seqs the state holds above that author's own announced latest seq
    + 1 (that author lies about its seq, or its heartbeat lags; the donor's own within
    `max_own_lead`)."""

    agreed_by: str = ""
    """How the peers reporting the state's applied set agreed with it: `nearest` (one within
    max_drift), `spread` (no farther from them than they are from each other), "" (none
    reports it)."""

    @property
    def num_unannounced(self) -> int:
        return sum(map(len, self.unannounced.values()))


def applied_digest(applied: Mapping[str, list[int]]) -> str:
    """The digest Replica.applied_digest computes, for an applied set not yet loaded."""
    lines = sorted(f"{author}:{seq}\n" for author, seqs in applied.items() for seq in seqs)
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def check_donor_state(
    state: Mapping[str, object],
    donor: str,
    peers: list[Heartbeat],
    sketch: Callable[[Mapping[str, object]], StateSketch],
    *,
    max_drift: float = MAX_DRIFT,
    max_rest: float = MAX_REST,
    max_distance: float = MAX_DISTANCE,
    max_own_lead: int = MAX_OWN_LEAD,
) -> StateVerdict:
    """StateCheckError when the donor's own heartbeat, or the replica sketches of peers other
    than `donor` with the same applied set, contradict `state`; else what it holds unannounced."""
    applied = state.get("applied")
    params = state.get("params")
    if not isinstance(applied, Mapping) or not isinstance(params, torch.Tensor):
        raise StateCheckError("the state lacks its applied set or parameters", check="malformed")
    unannounced = unannounced_seqs(applied, peers)
    own = unannounced.get(donor, [])
    if own and max(own) > _announced(donor, peers) + 1 + max_own_lead:
        raise StateCheckError(
            f"the state holds update {max(own)} of {donor}, its donor, beyond what the "
            f"donor's own heartbeat announced (+{max_own_lead})",
            check="own_seq",
            distances={"lead": float(max(own) - _announced(donor, peers) - 1)},
        )
    try:
        ours = sketch(state)
    except ValueError as exc:
        raise StateCheckError(
            f"the state's replica is malformed ({exc})", check="malformed"
        ) from None
    rest = relative_distance(ours.as_is, ours.settled)
    if rest is None or rest > max_rest:
        raise StateCheckError(
            f"the state's momentum would still move its parameters by {rest} of their norm",
            check="momentum",
            distances={} if rest is None else {"rest": rest},
        )
    try:
        seqs = parse_applied(applied)
    except ValueError as exc:
        raise StateCheckError(
            f"the state's applied set is malformed ({exc})", check="malformed"
        ) from None
    try:  # who co-signed the state's group updates, each count within its key's applied ones
        cosigned = parse_cosigned(state.get("cosigned"), seqs)
    except ValueError as exc:
        raise StateCheckError(
            f"the state's co-signer ledger is malformed ({exc})", check="malformed"
        ) from None
    others = [h for h in peers if h.peer_id != donor and h.sketch]
    weights = voucher_weights(applied, others, peers, donor, cosigned)  # records, not keys
    voters = [h for h in others if h.peer_id in weights]
    same = [h for h in voters if h.applied_digest == applied_digest(applied)]
    spread = same_digest_spread(same, weights)
    agreed_by = _check_same_digest(ours.settled, same, weights, spread, max_drift) if same else ""
    limit = max(max_distance, spread or 0.0)
    # Peers at genesis are left out: a donor long trained is far from them, honestly.
    trained = [h for h in voters if h.num_applied > 0]
    measured = ((relative_distance(ours.settled, h.sketch), weights[h.peer_id]) for h in trained)
    median = weighted_lower_median((d, w) for d, w in measured if d is not None)
    if median is not None and median > limit:
        raise StateCheckError(
            f"the state's parameters lie {median:.2f} of their norm or more from half the "
            f"other trained live peers' (by applied track record; at most {limit:.2f} "
            "is believed)",
            check="distance",
            distances={"median": median, "limit": limit},
        )
    return StateVerdict(unannounced, agreed_by)


def _check_same_digest(
    settled: list[float],
    same: list[Heartbeat],
    weights: Mapping[str, int],
    spread: float | None,
    max_drift: float,
) -> str:
    """StateCheckError unless `settled` lies within `max_drift` of one peer in `same` (they
    report the state's applied set: `nearest`) or no farther from them than they lie from
    each other (`spread`)."""
    to_same = [(relative_distance(settled, h.sketch), weights[h.peer_id]) for h in same]
    known = [(d, w) for d, w in to_same if d is not None]
    nearest = min((d for d, _ in known), default=None)
    if nearest is not None and nearest <= max_drift:
        return "nearest"
    central = weighted_lower_median(known)
    if spread is not None and central is not None and central <= spread:
        return "spread"
    measured = {"nearest": nearest, "median": central, "spread": spread}
    raise StateCheckError(
        "the state's parameters differ from those of peers with the same applied set "
        f"(nearest {nearest}, median {central}, their spread {spread})",
        check="same_digest",
        distances={k: v for k, v in measured.items() if v is not None},
    )


def same_digest_spread(same: list[Heartbeat], weights: Mapping[str, int]) -> float | None:
    """How far apart the peers reporting one applied set sit: per peer, the record-weighted
    lower median of its distances to the others; of those, the record-weighted lower median
    (over the MAX_SPREAD_VOTERS heaviest). None with fewer than two. An accomplice far from
    the honest peers moves neither median by more than its weight's share: it widens the
    spread only where it outweighs them (as it would outvote them in the distance check)."""
    heaviest = sorted(same, key=lambda h: (-weights.get(h.peer_id, 0), h.peer_id))
    voters = heaviest[:MAX_SPREAD_VOTERS]
    if len(voters) < 2:
        return None
    per_voter = []
    for v in voters:
        around = (
            (relative_distance(v.sketch, u.sketch), weights.get(u.peer_id, 0))
            for u in voters
            if u is not v
        )
        typical = weighted_lower_median((d, w) for d, w in around if d is not None)
        if typical is not None:
            per_voter.append((typical, weights.get(v.peer_id, 0)))
    return weighted_lower_median(per_voter)


def rank_donors(
    alive: list[Heartbeat],
    num_applied: int,
    path_rank: Callable[[str], int] | None = None,
    *,
    prefer: Callable[[str], bool] | None = None,
    spread: Callable[[str], int] | None = None,
) -> list[Heartbeat]:
    """Live peers to download a state from, best first: those that serve state and applied
    more than this replica's `num_applied`. A donor whose (num_applied, applied_digest) another
    live peer also reports is corroborated and comes first; corroboration by peers with an
    applied track record (dht.vouchers) before corroboration by keys without one; within each
    group, the most advanced first. A donor's progress is its own claim: a liar claiming a
    thousand more updates than anyone is tried after every corroborated donor, not before,
    and fresh keys echoing its claim place it after donors that established authors echo.
    With `path_rank` (peer id -> lower is reachable sooner, dht.reachability.path_rank), each
    of those three groups tries its best-connected donors first: behind NAT a donor with no
    live connection may not be dialable at all.

    `prefer` (a learner group's membership, dht.state_donors.in_group): donors it accepts come
    before all others, ranked among themselves as above: a member that takes another group's
    state leaves its group's one class (docs/scale.md). Their state is checked as any other's
    (check_donor_state), so a liar that ground a key into the group costs one refused download.
    `spread` (donor id -> a number that differs from node to node,
    dht.state_donors.spread_key) breaks ties between equally ranked donors, so joining nodes
    spread over them."""
    ahead = [h for h in alive if h.serves_state and h.num_applied > num_applied]
    echoes: dict[tuple[int, str], list[str]] = {}
    for h in alive:
        echoes.setdefault((h.num_applied, h.applied_digest), []).append(h.peer_id)
    reports = Reports(alive)

    def corroboration(donor: Heartbeat) -> tuple[int, ...]:
        claim = echoes[(donor.num_applied, donor.applied_digest)]
        others = [p for p in claim if p != donor.peer_id]
        weight = sum(reports.record(p) for p in others)
        preferred = int(prefer is not None and prefer(donor.peer_id))
        tie = -spread(donor.peer_id) if spread is not None else 0
        if path_rank is None:
            return (preferred, weight, len(claim) > 1, donor.num_applied, tie)
        group = 2 if weight > 0 else int(len(claim) > 1)
        return (preferred, group, -path_rank(donor.peer_id), weight, donor.num_applied, tie)

    return sorted(ahead, key=corroboration, reverse=True)


def _announced(author: str, peers: list[Heartbeat]) -> int:
    """The highest latest_seq `author`'s heartbeats among `peers` announce (0: none)."""
    return max((h.latest_seq for h in peers if h.peer_id == author), default=0)


def unannounced_seqs(applied: Mapping[str, object], peers: list[Heartbeat]) -> dict[str, list[int]]:
    """Per author with a heartbeat among `peers`, the seqs in `applied` above that heartbeat's
    latest_seq + 1 (one update may be in flight), ascending; authors with none are left out.
    With several heartbeats of one author (never from membership), the highest counts."""
    published: dict[str, int] = {}
    for h in peers:
        published[h.peer_id] = max(h.latest_seq, published.get(h.peer_id, h.latest_seq))
    found: dict[str, list[int]] = {}
    for author, seqs in applied.items():
        if author in published and isinstance(seqs, list):
            bound = published[author] + 1
            above = sorted(s for s in seqs if type(s) is int and s > bound)
            if above:
                found[author] = above
    return found
