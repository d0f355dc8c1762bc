"""Updates trained alone: applied as plain steps, not fed to the outer momentum (off by default).

An author that applied no other author's update while its round ran (signed staleness 0)
trained alone: a home while the only public node is down (the NAT chaos bench), a node cut
off by a partition, a newcomer training from genesis while its state check runs. Applied as
usual, each such update builds outer momentum; when the partitions meet, every replica takes
the others' whole backlogs within seconds, a round's share of momentum folded in for every
M of them, so the momentum built by several rounds of updates trained apart is applied again
and again in one burst. On the virtual clock (bench.correction_sim, 4 equal learners, H =
10, seed 0, `--partition 60:120`) that burst, not the weight, is most of the partition's
harm: val loss 4.07 with the backlog applied as regular steps, 2.87 with the backlog as plain
steps (an oracle marking the held-back arrivals), 2.87 without any partition (docs/nat.md,
session 17).

The rule here is the signed-only form of that oracle (`+zeroplain` there: 2.78-2.99 at
`--partition 60:120` and 2.85-2.97 at `40:120`, seeds 0-2, against 4.04-4.78 and 4.98-6.82
as main weighs, 2.87-2.97 without a partition): an update signed with staleness 0,
sized by more than one learner, is applied as a plain step (merge.outer.OuterOptimizer
.plain_step, as a flush is): the same weight, no momentum built, no share of a round. It
reads the update's signed staleness and the learner count it is sized by, nothing of the
receiver's arrival order, so every replica (the author's own included) applies such an
update the same way, and the settled point of a set of updates (merge.outer.rest_terms) is
the same in any order (tests/unit/test_solo.py). A liar signing staleness 0 only gives up
the momentum its update would have built; one signing a higher staleness is weighed down as
now. The price: a healthy swarm's updates signed 0 (a swarm's first round; a fast learner
among slow ones, which may finish a round before any peer publishes) build no momentum
either (docs/nat.md, session 17, has the measured effect on the default arms).

Pure: `SoloConfig` (a merge setting, in the fingerprint if wired) and `solo_plain`. Not wired
into merge.pipeline (the lead decides).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SoloConfig:
    """Whether updates trained alone are applied as plain steps."""

    plain: bool = False
    """True: an update signed with staleness 0 and sized by more than one learner is a plain
    step (no momentum built, no share of a round); False (default): as every update."""

    def __post_init__(self) -> None:
        if type(self.plain) is not bool:
            raise ValueError(f"solo plain must be a bool, got {self.plain!r}.")


def solo_plain(config: SoloConfig, staleness: int, learners: int) -> bool:
    """Whether an update signed `staleness` stale, sized by `learners` learners, is applied as
    a plain step: its author applied no one's update while its round ran, in a swarm of more
    than one learner. ValueError for a negative staleness or fewer than one learner."""
    if type(staleness) is not int or staleness < 0:
        raise ValueError(f"staleness must be an integer >= 0, got {staleness!r}.")
    if type(learners) is not int or learners < 1:
        raise ValueError(f"learners must be an integer >= 1, got {learners!r}.")
    return config.plain and staleness == 0 and learners > 1
