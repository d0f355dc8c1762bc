"""What a replica does on learning a proof of equivocation, a solo author's or a learner
group's alike: carries out merge.equivocation's answer (record the id with no contribution,
or withdraw the variant applied here) and marks the id settled. The solo path
(merge.pipeline) and the group path (merge.group_pipeline) differ only in the header a
recorded id is applied under and in what a withdrawal takes back."""

from __future__ import annotations

from collections.abc import Callable

import torch

from merge.envelope import UpdateHeader
from merge.equivocation import Action, EquivocationBook, Evidence, VariantKey
from merge.replica import Replica

NO_GRADIENT = torch.empty(0)
"""What a weight-0 apply is given: it reads none."""


def settle(
    book: EquivocationBook,
    replica: Replica,
    proof: Evidence,
    *,
    recorded: Callable[[], UpdateHeader],
    withdraw: Callable[[], object],
    applied_variant: VariantKey | None = None,
) -> Action:
    """What `book` answers on learning `proof`, carried out on `replica` (whose lock the caller
    holds): "record" applies `recorded()` with no contribution, "withdraw" calls `withdraw`;
    then the id is settled. `applied_variant`: the group variant applied under the id, where
    known (EquivocationBook.learn)."""
    uid = proof.update_id
    action = book.learn(proof, applied=replica.has_applied(*uid), applied_variant=applied_variant)
    if action == "record":
        replica.apply(recorded(), NO_GRADIENT, 0.0, credited=0.0)
    elif action == "withdraw":
        withdraw()
    book.settled(uid)
    return action
