"""What dht/ asks of the merge: the small interface the swarm's parts call, so the network
layer depends on it and not on merge.pipeline.UpdatePipeline (which satisfies it).

Gossip checks pushed and announced headers, submits fetched updates and settles proofs of
equivocation (an author's and a learner group's); state transfer serves this replica's state
and adopts a donor's. Everything here is thread-safe on the pipeline's side: gossip calls it
from its merge pool, off the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from merge.envelope import SignedHeader, SignedUpdate, UpdateHeader
from merge.equivocation import Action, Proof, UpdateId
from merge.group_equivocation import GroupProof
from merge.group_update import GroupUpdate
from merge.rejections import RejectionLog
from merge.replica import Replica
from merge.result import MergeResult

AppliedUpdate = Callable[[UpdateHeader], SignedUpdate | None]
"""The variant applied here under a header's id (its retained copy), or None."""
AppliedGroup = Callable[[UpdateId], GroupUpdate | None]
"""The learner group's variant applied here under an id (its retained copy), or None."""


@runtime_checkable
class MergePort(Protocol):
    """The merge as the swarm sees it (merge.pipeline.UpdatePipeline is one)."""

    @property
    def replica(self) -> Replica:
        """The replica updates are applied to: its applied set and digest drive repair."""
        ...

    @property
    def rejection_log(self) -> RejectionLog:
        """Rejections per peer and reason, shared with the swarm's own refusals."""
        ...

    def check_header(self, signed: SignedHeader) -> str | None:
        """The rejection reason a header alone earns (before its payload is fetched), or None."""
        ...

    def evidence(self, signed: SignedHeader) -> Proof | None:
        """The proof of equivocation `signed` makes with the variant applied here, if any."""
        ...

    def submit(self, update: SignedUpdate) -> MergeResult:
        """Verify, validate, weigh and apply one update; what became of it."""
        ...

    def submit_group(self, update: GroupUpdate, in_group: Callable[[str], bool]) -> MergeResult:
        """Verify and apply a learner group's update as one unit (`in_group`: whether a peer id
        belongs to its group); what became of it."""
        ...

    def learn_proof(self, proof: Proof, applied_update: AppliedUpdate) -> Action:
        """Settle a checked proof of equivocation the same way on every replica."""
        ...

    def group_evidence(self, update: GroupUpdate) -> GroupProof | None:
        """The proof of a group's equivocation `update` makes with the variant applied here."""
        ...

    def learn_group_proof(self, proof: GroupProof, applied_group: AppliedGroup) -> Action:
        """Settle a checked proof of a group's equivocation the same way on every replica."""
        ...

    def transfer_state(self) -> dict[str, object]:
        """The replica and what judges its updates, taken at one moment (served to newcomers)."""
        ...

    def adopt(self, state: dict[str, Any]) -> None:
        """Load a donor's transfer_state in place of this replica, all or nothing."""
        ...

    def is_fresh_author(self, author: str) -> bool:
        """Whether `author` has no track record here yet (its retained updates share the
        fresh keys' part of the memory budget: dht.retention)."""
        ...
