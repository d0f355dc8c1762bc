"""What the merge decides by besides the replica (the robust filters' windows, the learner
floor, the contribution ledger), saved with the replica and handed to newcomers. A mixin of
merge.pipeline.UpdatePipeline, which sets these fields; `adopt` (there) loads a donor's."""

from __future__ import annotations

from merge.contribution import ContributionLedger
from merge.equivocation import EquivocationBook
from merge.group_equivocation import GroupRun
from merge.learners import LearnerFloor
from merge.merge_config import MergeConfig
from merge.replica import Replica
from merge.robust import RobustFilter
from merge.weighing_journal import WeighingJournal

ALONE_AFTER_SKEWS = 3.0
"""An author is alone (merge.contribution) once every other author's latest update is signed
this many `max_clock_skew_s` before its own."""


class PipelineState:
    """The merge state of merge.pipeline.UpdatePipeline: saved, restored, transferred."""

    replica: Replica
    config: MergeConfig
    robust: RobustFilter
    _robust: list[RobustFilter]
    learner_floor: LearnerFloor
    ledger: ContributionLedger
    equivocation: EquivocationBook
    weighing: WeighingJournal
    group_run: GroupRun | None

    def state_dict(self) -> dict[str, object]:
        """What the pipeline decides by besides the replica: the robust filters' windows and
        the learner floor. Checkpointed with the replica: a node restarted without them judged
        and sized updates unlike its peers, and their replicas stayed apart for good."""
        with self.replica.lock:
            return {
                "robust": [robust.state_dict() for robust in self._robust],
                "learner_floor": self.learner_floor.state_dict(),
                "ledger": self.ledger.state_dict(),
            }

    def load_state_dict(self, state: object) -> None:
        """Restores what state_dict saved (None: a checkpoint from before it, left as is)."""
        if state is None:
            return
        parts = state if isinstance(state, dict) else {}
        robust = parts.get("robust")
        if not isinstance(robust, list) or len(robust) != len(self._robust):
            raise ValueError(f"merge state must hold {len(self._robust)} robust filter states.")
        if not all(isinstance(r, dict) for r in robust):
            raise ValueError("merge state's robust filter states must be mappings.")
        ledger = self._new_ledger()
        if parts.get("ledger") is not None:  # checkpoints before budgets lack it: none earned
            ledger.load_state_dict(parts["ledger"])
        with self.replica.lock:
            self.learner_floor.load_state_dict(parts.get("learner_floor"))
            self.ledger = ledger
            for robust_filter, robust_state in zip(self._robust, robust, strict=True):
                robust_filter.load_state_dict(robust_state)
            self.attach_weighing()

    def attach_weighing(self) -> None:
        """Journals what weighs later updates from its state now (merge.weighing_journal),
        where learner groups are on (their superseded variants are what it takes back)."""
        if self.group_run is None:
            return
        with self.replica.lock:
            self.weighing.attach(
                self.replica.credit, *self._robust, self.learner_floor, self.ledger
            )  # fmt: skip

    def _new_ledger(self) -> ContributionLedger:
        # Alone after 3x the clock skew a receiver tolerates: a flooder dating its updates
        # ahead cannot look alone while honest learners publish every 2x that skew or faster.
        alone_after_s = ALONE_AFTER_SKEWS * self.config.max_clock_skew_s
        return ContributionLedger(self.config.robust.budget, alone_after_s=alone_after_s)

    def window_sizes(self) -> dict[str, int]:
        """How much history the decisions stand on: accepted norms in the (first) robust
        window, updates in the learner floor's window."""
        with self.replica.lock:
            return {"robust_norms": len(self.robust), "floor_updates": len(self.learner_floor)}

    def transfer_state(self) -> dict[str, object]:
        """What a newcomer loads (dht.state_transfer): the replica's state_dict with this
        pipeline's state ("merge") and its proofs of equivocation ("equivocation", hex), taken
        at one moment, so the newcomer judges and sizes the next updates as this replica
        does (merge.handover)."""
        with self.replica.lock:
            state = self.replica.state_dict()
            state["merge"] = self.state_dict()
            book = self.equivocation.state_dict()
        proofs = book["proofs"]
        assert isinstance(proofs, list)
        state["equivocation"] = {
            "proofs": [p.hex() for p in proofs],
            "settled": book["settled"],
            "awaiting": book["awaiting"],  # withdrawn lesser variants (merge.equivocation)
        }
        return state
