"""Whose heartbeat vouches for a donor's state, and how much: applied track records, not keys.

In an open swarm anyone can mint keys, and a key's heartbeat costs nothing: three accomplice
heartbeats reporting a poisoned state's sketch made a newcomer load it (bench.attack, 1.18x
loss), because the state check counted keys. Here each live peer's vote weighs its *applied
track record*: how many of its own updates the swarm applied, from evidence the newcomer can
check, and a key with no record has no vote.

- heartbeat record of V: how many of V's updates other live peers (never V itself) report
  applied in their signed heartbeats (`merged_by_author`, the highest report), capped by V's
  own signed `latest_seq`. The donor's report counts: in a swarm of two honest peers the
  donor is the only one that reports the other's updates;
- state record of V: the same, capped again by the number of V's updates in the checked
  state's sealed applied set at or below V's announced seq + 1; plus, with learner groups
  (whose updates are authored by group keys), V's group record in the state: per group key,
  the key's updates in the state that V co-signed (the state's co-signer ledger, at most the
  key's updates in its applied set), at most the highest report of that key by another live
  peer (`group_record`, as dht.realign weighs donors).

The vote uses state records; when no voucher has one (the state holds no voucher's updates:
a donor serving an emptied or fabricated applied set), heartbeat records, so established
authors still judge the state; when no live peer has either (a swarm's first minutes), every
trained peer's heartbeat counts once, as before.

Limits (open swarms cannot tell keys from people; `--allow-keys` can): keys that publish
updates the swarm applies earn a record over time, and a clique of keys that report each
other's updates, served in a state that fabricates those updates, gets a record in that
state; the honest record holders' weight still counts against it.

Pure: no network, no clock (dht.state_check calls it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from dht.heartbeat import Heartbeat


class Reports:
    """Who reports how many of each author's updates applied (signed `merged_by_author`),
    the two highest reports per author: enough to leave out the author's own. Built in
    O(peers x MAX_AUTHORS) once; a thousand Sybil heartbeats cost no quadratic work."""

    def __init__(self, peers: list[Heartbeat]) -> None:
        self._latest_seq: dict[str, int] = {}
        self._top: dict[str, list[tuple[int, str]]] = {}
        for h in peers:
            self._latest_seq[h.peer_id] = max(h.latest_seq, self._latest_seq.get(h.peer_id, 0))
            for author, count in h.merged_by_author.items():
                top = self._top.setdefault(author, [])
                top.append((count, h.peer_id))
                top.sort(reverse=True)
                del top[2:]

    def record(self, voucher: str) -> int:
        """`voucher`'s updates the highest other reporter applied, at most the voucher's own
        signed latest_seq."""
        return min(self.top(voucher, besides=voucher), self._latest_seq.get(voucher, 0))

    def top(self, author: str, *, besides: str) -> int:
        """The highest report of `author`'s updates applied by a reporter other than
        `besides` (0: none)."""
        return next((c for c, r in self._top.get(author, []) if r != besides), 0)


def group_record(reports: Reports, cosigned: Mapping[str, Mapping[str, int]], member: str) -> int:
    """`member`'s share of the learner groups' records: per group key, the updates of it that
    this replica applied and `member` co-signed (`cosigned`: merge.cosign_ledger, built from
    the co-signatures the merge verified), at most the highest report of that key by another
    live peer; summed. A function of the applied set and the heartbeats alone, so alike on
    every replica that applied one set and sees the same heartbeats; a member cannot claim an
    update it did not co-sign, and a fresh key co-signed nothing applied here."""
    keys = cosigned.get(member, {})
    return sum(min(count, reports.top(key, besides=member)) for key, count in keys.items())


def heartbeat_records(
    peers: list[Heartbeat], donor: str, reports: Reports | None = None
) -> dict[str, int]:
    """Per live peer other than `donor`, its updates that another live peer reports applied,
    at most its own signed latest_seq; only positive records."""
    reports = reports or Reports(peers)
    records: dict[str, int] = {}
    for voucher in peers:
        if voucher.peer_id != donor and (record := reports.record(voucher.peer_id)) > 0:
            records[voucher.peer_id] = record
    return records


def state_records(
    applied: Mapping[str, object],
    peers: list[Heartbeat],
    donor: str,
    cosigned: Mapping[str, Mapping[str, int]] | None = None,
) -> dict[str, int]:
    """Heartbeat records capped by each voucher's updates in the state's applied set that its
    own heartbeat announced (latest_seq + 1 at most), plus its share of the learner groups'
    records in the state (`cosigned`: the state's co-signer ledger, merge.cosign_ledger, each
    count already at most its key's updates in the state: `parse_cosigned`); only positive
    records. With groups the authors are group keys, so without the ledger every member's
    record was 0 and the vote fell back to one per key."""
    announced = {h.peer_id: h.latest_seq for h in peers}
    reports = Reports(peers)
    records: dict[str, int] = {}
    for voucher, record in heartbeat_records(peers, donor, reports).items():
        seqs = applied.get(voucher)
        in_state = _count_within(seqs, announced[voucher] + 1) if isinstance(seqs, list) else 0
        if min(record, in_state) > 0:
            records[voucher] = min(record, in_state)
    for voucher in announced.keys() - {donor}:
        if (shared := group_record(reports, cosigned or {}, voucher)) > 0:
            records[voucher] = records.get(voucher, 0) + shared
    return records


def voucher_weights(
    applied: Mapping[str, object],
    vouchers: list[Heartbeat],
    peers: list[Heartbeat],
    donor: str,
    cosigned: Mapping[str, Mapping[str, int]] | None = None,
) -> dict[str, int]:
    """The weight of each of `vouchers` (peers other than the donor) in the vote on a state:
    state records (with its co-signer ledger `cosigned`), else heartbeat records, else one per
    voucher (see the module's doc)."""
    state = state_records(applied, peers, donor, cosigned)
    for records in (state, heartbeat_records(peers, donor)):
        weights = {v.peer_id: records[v.peer_id] for v in vouchers if v.peer_id in records}
        if weights:
            return weights
    return {v.peer_id: 1 for v in vouchers}


def weighted_lower_median(weighted: Iterable[tuple[float, int]]) -> float | None:
    """The least value that at least half of the total weight lies at or below (None when
    nothing weighs anything): with equal weights, the lower median."""
    ordered = sorted((value, weight) for value, weight in weighted if weight > 0)
    total = sum(weight for _, weight in ordered)
    cumulative = 0
    for value, weight in ordered:
        cumulative += weight
        if 2 * cumulative >= total:
            return value
    return None


def _count_within(seqs: list[object], bound: int) -> int:
    return sum(1 for s in seqs if type(s) is int and 1 <= s <= bound)
