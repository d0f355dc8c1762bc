"""Replays learner groups' updates through the contribution budget with the pure classes
(docs/scale.md, session 21): the price of charging a group's update to its co-signers.

One replica's decisions, composed from the functions both merge paths call
(merge.group_pipeline `floor_votes`, `sized`, `charge`; ContributionLedger's
`group_allowance` / `group_applied`; the co-sign ledger; the learner floor), every update of
full substance. Scenarios:

- regroup: 8 groups of 4 established members for 40 rounds, then a split to 16 groups of 2;
  the budget keyed by the group key (session 20's replay) beside the member-charged one;
- burst: 8 groups of 2 established members for 40 rounds, then newcomers join (by random
  peer-id bits) and the swarm splits to 16 groups `--wait` rounds later;
- grind: an adversary's own group of k fresh keys beside 8 honest groups of 4, publishing
  4 updates per honest round (and k fresh solo keys, one update each per round, to compare);
- sybil: K group keys of fresh members claiming 1 learner against 8 honest groups.

    PYTHONPATH=$PWD python -m bench.group_budget

Prints one JSON line per scenario. Deterministic (seeded).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from merge.contribution import ContributionLedger
from merge.cosign_ledger import CosignLedger
from merge.group_pipeline import charge, floor_votes, sized
from merge.group_update import GROUP_AUTHOR_PREFIX
from merge.learners import LearnerFloor
from merge.robust import Verdict

HONEST = Verdict(None, 1.0, None, None)
"""An update of full substance (no reference: substance 1)."""


def key(bits: str) -> str:
    return f"{GROUP_AUTHOR_PREFIX}{bits}"


@dataclass
class Replica:
    """What one replica decides a group update by, fed as both merge paths feed it."""

    ledger: ContributionLedger = field(default_factory=ContributionLedger)
    floor: LearnerFloor = field(default_factory=LearnerFloor)
    cosigned: CosignLedger = field(default_factory=CosignLedger)
    per_key: bool = False
    """Session 20's rejected design: the budget keyed by the group key."""

    def submit(self, group: str, members: Sequence[str], claim: int) -> tuple[int, float]:
        """(learners it was sized by, allowance) of one group update, applied."""
        votes = floor_votes(self.ledger, self.cosigned.cosigners)
        if self.per_key:  # group keys with accounts of their own, counted as solo authors
            votes = self.ledger.individually_counted(), not self.ledger.any_established()
        learners = sized(self.floor, group, claim, votes)
        if self.per_key:
            allowance = self.ledger.allowance(group, learners)
        else:
            allowance = self.ledger.group_allowance(members, learners)
        self.cosigned.credit(group, members)
        if self.per_key:
            evidence = min(1.0, self.floor.num_authors(group) / claim)
            self.ledger.applied(group, learners, allowance, None, evidence)
        else:
            charge(self.ledger, self.floor, members, (group, claim, learners), allowance, HONEST)
        if allowance > learners / 1024:  # moved the replica (merge.contribution.budgeted)
            self.floor.applied(group, claim, None)
        return learners, allowance

    def solo(self, author: str, claim: int) -> float:
        votes = floor_votes(self.ledger, self.cosigned.cosigners)
        learners = self.floor.effective(author, claim, *votes, None)
        allowance = self.ledger.allowance(author, learners)
        evidence = min(1.0, self.floor.num_authors(author) / claim)
        self.ledger.applied(author, learners, allowance, None, evidence)
        if allowance > learners / 1024:
            self.floor.applied(author, claim, None)
        return allowance


def groups_of(members: Sequence[str], ids: dict[str, str], bits: int) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for member in members:
        out.setdefault(key(ids[member][:bits]), []).append(member)
    return out


def run_rounds(
    replica: Replica, groups: dict[str, list[str]], rounds: int, rng: random.Random
) -> list[list[float]]:
    """`rounds` rounds, each non-empty group publishing once in a random order; allowances."""
    out = []
    for _ in range(rounds):
        order = sorted(groups)
        rng.shuffle(order)
        claim = len(groups)
        out.append([replica.submit(g, groups[g], claim)[1] for g in order])
    return out


def founded(replica: Replica, num_members: int, bits: int, rounds: int, seed: int):
    """A swarm of `num_members` members on 2^bits groups (ids spread evenly), `rounds` rounds."""
    rng = random.Random(seed)
    width = 8
    members = [f"m{i:03d}" for i in range(num_members)]
    ids = {m: format(i * (1 << width) // num_members, f"0{width}b") for i, m in enumerate(members)}
    run_rounds(replica, groups_of(members, ids, bits), rounds, rng)
    return members, ids, rng


def summary(allowances: list[list[float]]) -> dict[str, object]:
    flat = [a for r in allowances for a in r]
    full = [i for i, r in enumerate(allowances) if min(r) >= 1.0]
    return {
        "first_round_mean": round(sum(allowances[0]) / len(allowances[0]), 3),
        "second_round_mean": round(sum(allowances[1]) / len(allowances[1]), 3),
        "mean": round(sum(flat) / len(flat), 3),
        "min": round(min(flat), 3),
        "rounds_held_back": sum(1 for r in allowances if min(r) < 1.0),
        "first_round_all_whole": full[0] if full else None,
    }


def regroup(rounds: int) -> dict[str, object]:
    out: dict[str, object] = {"scenario": "regroup 8x4 -> 16x2", "rounds": rounds}
    for per_key in (True, False):
        replica = Replica(per_key=per_key)
        members, ids, rng = founded(replica, 32, 3, rounds, seed=1)
        after = run_rounds(replica, groups_of(members, ids, 4), rounds, rng)
        accounts = [g for g in groups_of(members, ids, 4)] if per_key else members
        row = summary(after) | {
            "established_after": sum(map(replica.ledger.is_established, accounts)),
            "of": len(accounts),
        }
        out["per_group_key" if per_key else "member_charged"] = row
    return out


def burst(newcomers: int, wait: int, rounds: int) -> dict[str, object]:
    replica = Replica()
    members, ids, rng = founded(replica, 16, 3, rounds, seed=2)
    fresh = [f"n{i:03d}" for i in range(newcomers)]
    ids |= {n: format(rng.randrange(256), "08b") for n in fresh}
    everyone = members + fresh
    before = run_rounds(replica, groups_of(everyone, ids, 3), wait, rng) if wait else []
    split = groups_of(everyone, ids, 4)
    fresh_led = sum(1 for m in split.values() if 2 * sum(1 for x in m if x in fresh) > len(m))
    after = run_rounds(replica, split, rounds, rng)
    row = summary(after) | {
        "scenario": f"burst of {newcomers}, split {wait} rounds later",
        "groups": len(split),
        "fresh_led_groups": fresh_led,
        "held_back_before_split": sum(1 for r in before if min(r) < 1.0),
        "newcomers_established_after": sum(map(replica.ledger.is_established, fresh)),
    }
    return row


def grind(k: int, rounds: int, *, solo: bool) -> dict[str, object]:
    """The adversary's share of the replica's progress per honest round: its k fresh keys as
    one group publishing 4 updates a round, or as k solo keys publishing one each."""
    replica = Replica()
    members, ids, rng = founded(replica, 32, 3, rounds, seed=3)
    honest = groups_of(members, ids, 3)
    adversary = [f"x{i:03d}" for i in range(k)]
    shares, established_at = [], None
    for r in range(rounds):
        claim, moved = len(honest), 0.0
        for g in sorted(honest):
            replica.submit(g, honest[g], claim)
        if solo:
            moved = sum(replica.solo(x, claim) / claim for x in adversary)
        else:
            for _ in range(4):
                learners, allowance = replica.submit(key("1" * 9), adversary, claim)
                moved += allowance / learners
        shares.append(moved)
        if established_at is None and any(map(replica.ledger.is_established, adversary)):
            established_at = r
    return {
        "scenario": f"grind {k} fresh keys" + (" as solo keys" if solo else " into one group"),
        "share_per_round_first_8": round(sum(shares[:8]) / 8, 3),
        "share_per_round_last_8": round(sum(shares[-8:]) / 8, 3),
        "honest_group_share": round(1 / len(honest), 3),
        "first_established_round": established_at,
        "established_after": sum(map(replica.ledger.is_established, adversary)),
    }


def sybil(num_keys: int, rounds: int) -> dict[str, object]:
    """K group keys of one fresh member each claiming 1, every round before the honest
    groups: the first round a liar is sized by less than the honest 8, and how many of the
    liars' members were established by then (they earn record at the cohort's rate)."""
    replica = Replica()
    members, ids, rng = founded(replica, 32, 3, rounds, seed=4)
    honest = groups_of(members, ids, 3)
    liars = {key("1" * 6 + format(i, "06b")): [f"y{i:03d}"] for i in range(num_keys)}
    honest_sizes, first_low, established_then = set(), None, None
    for r in range(rounds):
        sizes = [replica.submit(g, liars[g], 1)[0] for g in sorted(liars)]
        for g in sorted(honest):
            honest_sizes.add(replica.submit(g, honest[g], len(honest))[0])
        if first_low is None and min(sizes) < len(honest):
            first_low = r
            established_then = sum(replica.ledger.is_established(m[0]) for m in liars.values())
    return {
        "scenario": f"sybil of {num_keys} group keys of fresh members claiming 1",
        "rounds": rounds,
        "honest_sized_by": sorted(honest_sizes),
        "first_round_a_liar_sized_below_8": first_low,
        "liar_members_established_then": established_then,
        "liar_members_established_after": sum(
            replica.ledger.is_established(m[0]) for m in liars.values()
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    rounds = args.rounds
    rows = [regroup(rounds)]
    for newcomers, wait in ((8, 0), (16, 0), (32, 0), (16, 10)):
        rows.append(burst(newcomers, wait, rounds))
    for k, solo in ((4, False), (16, False), (64, False), (16, True)):
        rows.append(grind(k, rounds, solo=solo))
    for num_keys in (9, 16, 64):
        rows.append(sybil(num_keys, 2 * rounds))
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
