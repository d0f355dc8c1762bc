"""What an update's signed header earns before it is applied: the reasons the merge refuses it
for (its claims, trust, novelty, norm), and the facts every replica reads off it alike
(`learners_of`, `staleness_of`). A mixin of merge.pipeline.UpdatePipeline: pure checks on
its replica, config and equivocation book; nothing counted or logged here."""

from __future__ import annotations

import math
from collections.abc import Callable

from merge.codecs import CODECS
from merge.envelope import EnvelopeError, SignedHeader, UpdateHeader, verify_header
from merge.equivocation import EquivocationBook
from merge.merge_config import MergeConfig
from merge.replica import Replica

MIN_PARAMS_NORM = 1e-12
"""The floor under the params norm that the norm cap is a multiple of."""


class UpdateChecks:
    """The rejection reasons of merge.pipeline.UpdatePipeline (which sets these fields)."""

    replica: Replica
    config: MergeConfig
    fingerprint: str
    admit: Callable[[str], bool] | None
    clock: Callable[[], float]
    equivocation: EquivocationBook

    def check_header(self, signed: SignedHeader) -> str | None:
        """The rejection reason a header alone earns, or None; usable before fetching a payload.

        Pure: it neither counts nor logs, so callers may poll announcements with it.
        """
        try:
            verify_header(signed)
        except EnvelopeError as e:
            return e.reason
        h = signed.header
        return self._claims_reason(h) or self._trust_reason(h) or self._novelty_reason(h)

    def _trust_reason(self, h: UpdateHeader) -> str | None:
        """Who may contribute, clocks and counters no honest peer produces, equivocation."""
        if self.admit is not None and not self.admit(h.author):
            return "not_allowed"
        if h.created_at > self.clock() + self.config.max_clock_skew_s:
            return "future_timestamp"
        if h.seq > max(self.replica.last_seq(h.author), 0) + self.config.max_seq_jump:
            return "seq_too_far"
        if self.equivocation.is_equivocated(h.update_id):
            return "equivocation"  # proven: no variant of it is applied here any more
        applied = self.equivocation.applied_variant(h.update_id)
        if applied is not None and applied[0].header.payload_digest != h.payload_digest:
            return "equivocation"  # the same id with another payload: never applied twice
        return None

    def _claims_reason(self, h: UpdateHeader) -> str | None:
        limits = self.config
        if h.fingerprint != self.fingerprint:
            return "wrong_run"
        if h.codec not in CODECS:
            return "unknown_codec"
        run_fragments = self.replica.num_fragments
        if h.fragments != (None if run_fragments == 1 else run_fragments):
            return "bad_fragment"  # a whole update in a run with fragments, or the reverse
        if h.numel != self.replica.update_numel(h.fragment):
            return "wrong_size"  # for a fragment: not the size of that fragment of the model
        if h.seq < 0 or h.base_applied < 0 or h.base_applied > h.published_applied:
            return "bad_counters"
        if not 1 <= h.inner_steps <= limits.max_inner_steps:
            return "bad_steps"
        if not 0 < h.tokens <= h.inner_steps * limits.max_tokens_per_step:
            return "bad_tokens"
        if not 1 <= learners_of(h) <= limits.max_learners:
            return "bad_learners"
        if not math.isfinite(h.loss):
            return "non_finite"
        if staleness_of(h) > limits.max_staleness:
            return "too_stale"
        return None

    def _novelty_reason(self, h: UpdateHeader) -> str | None:
        with self.replica.lock:
            if self.replica.has_applied(h.author, h.seq):
                return "duplicate"
        # No "seq <= last applied" rule: an update that arrives late or after a later one of
        # its author is still applied; membership in the applied set is what counts.
        return None

    def _norm_reason(self, update_norm: float) -> str | None:
        # Against the whole model's norm, a fragment's too: a fragment's own tensors can be
        # small at genesis (an honest early fragment outgrows them); the per-fragment robust
        # filter bounds a fragment against its own history.
        ratio = self.config.max_update_norm_ratio
        bounds = self.replica.params_norm_bounds()
        if bounds is not None:  # the verdict of the exact norm, when the bounds settle it
            # x -> ratio * max(x, tiny) is monotone in floats, so lo <= norm <= hi carries over.
            if update_norm <= ratio * max(bounds[0], MIN_PARAMS_NORM):
                return None
            if update_norm > ratio * max(bounds[1], MIN_PARAMS_NORM):
                return "norm_too_large"
        params_norm = self.replica.params_norm()
        if update_norm > ratio * max(params_norm, MIN_PARAMS_NORM):
            return "norm_too_large"
        return None


def learners_of(header: UpdateHeader) -> int:
    """The learner count an update is sized by; a v1 header (without one) counts as one."""
    return 1 if header.learners is None else header.learners


def staleness_of(header: UpdateHeader) -> int:
    """Staleness in updates of the same share of the model: a fragment update (1 of P) counts
    the updates applied during its round over P, as P fragments of each round were applied.

    So a fragment is weighed and corrected like a whole update in the same swarm would be.
    """
    return header.staleness // (header.fragments or 1)
