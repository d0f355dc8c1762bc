"""Robust merging: take no harm from well-signed updates that would hurt the model.

A norm cap relative to the parameters (the pipeline's `max_update_norm_ratio`) stops gross
updates, but a hostile peer can stay just under it: honest pseudo-gradients are ~10 % of the
parameter norm, so a cap of 1x leaves room for updates ten times larger than anyone else's,
and a well-scaled update can still point against the training direction. Two checks close
that gap, both pure functions of the replica's state and the update:

- norm outlier: once `warmup` updates are accepted, an update whose norm exceeds
  `max_norm_to_median` times the reference norm (the median over authors of each author's
  median recent norm, see RobustFilter) is clipped to that bound (counted as `norm_outlier`);
- against momentum: an update whose cosine to the outer optimizer's momentum (the direction
  the swarm has been moving in) is below `min_cosine` contributes nothing (counted as
  `against_momentum`): it would undo the swarm's progress rather than add to it;
- off center (centered clipping, Karimireddy et al., "Learning from History for Byzantine
  Robust Optimization"): the update's deviation from the momentum's direction at the
  reference norm is clipped to `center_radius` times the reference (`fresh_center_radius`
  for authors without a track record): a near-cap update pointing sideways keeps at most an
  honest-sized deviation (counted as `off_center`).

A flush (merge.envelope's flush marker: the residual of error feedback its author had not
sent, sent once, dense, as it stops) spans the rounds since its author's previous flush: it
holds what each of them left out, by construction off the momentum (what the rounds sent).
Judged like one round's update, an honest flush of 8 rounds was recentered as off center
(docs/codecs.md: 7 of 8 at M = 8, H = 25). So a flush's centered-clipping radius is the
round's times the rounds it spans (`spans`: its author's applied rounds since its previous
flush, at most `window`; at least 1): the deviation its author's rounds could have taken one
by one. Only its direction is judged apart, not its size: a flush beyond the norm bound
(`max_norm_to_median` times the reference) is judged as a round's update, as is one against
the momentum, so whatever it spans a flush lets through at most that bound. Without a round
since its previous flush a flush is judged exactly as a round's update: a peer marking
every update as a flush, or alternating rounds and flushes, gets the verdicts it got before.

No verdict refuses the update's id: the pipeline applies it with its contribution
clipped or zeroed. The median window and the momentum are the same on every replica only up
to the order of the last few updates (the consistency model of DESIGN.md), so two replicas
can judge an update near a threshold differently; were that a refusal, their applied sets
would differ for good (measured with bench.scale at N = 4 and 8 before this rule). As it is,
they keep one applied set and differ at most by one clipped contribution, which the drift
figure shows. Thresholds sit far from honest values (honest norms stay within ~2x of the
median, honest cosines are positive: tests/unit/test_merge_robust.py and docs/trust.md).
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from merge.contribution import BudgetConfig
from merge.weighing_journal import Journaled

REASONS = ("norm_outlier", "against_momentum", "off_center")
MAX_AUTHORS = 256
"""Authors whose recent norms a robust window keeps; the least recently recorded go first."""


@dataclass(frozen=True, kw_only=True)
class RobustConfig:
    """Thresholds of the robust checks; part of the run fingerprint (every replica uses them)."""

    window: int = 32
    """Accepted update norms kept per author; the reference is over authors' medians of them."""
    warmup: int = 4
    """Accepted updates before the relative norm bound applies."""
    max_norm_to_median: float = 4.0
    """Updates with a norm above this times the reference norm are clipped to it (0: off);
    norms are recorded clamped into [reference / this, reference * this]."""
    min_cosine: float = -0.5
    """Updates whose cosine to the outer momentum is below this contribute nothing (-1: off)."""
    center_radius: float = 2.0
    """Centered clipping: an update's deviation from the momentum's direction at the reference
    norm is clipped to this times the reference norm (0: off)."""
    fresh_center_radius: float = 1.0
    """The same radius for authors without a track record (merge.contribution)."""
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    """Per-author contribution budgets and track records (merge.contribution)."""

    def __post_init__(self) -> None:
        if type(self.window) is not int or self.window < 1:
            raise ValueError(f"robust window must be an integer >= 1, got {self.window!r}.")
        if type(self.warmup) is not int or not 1 <= self.warmup <= self.window:
            raise ValueError(
                f"robust warmup must be an integer in [1, window], got {self.warmup!r}."
            )
        for name in ("max_norm_to_median", "center_radius", "fresh_center_radius"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")
        if not isinstance(self.min_cosine, int | float) or not -1 <= self.min_cosine <= 1:
            raise ValueError(f"min_cosine must be in [-1, 1], got {self.min_cosine!r}.")


@dataclass(frozen=True)
class Verdict:
    """What the robust checks decided about one update, with the figures they used."""

    reason: str | None
    norm: float
    median_norm: float | None
    """The reference norm (median over voting authors of their median norms)."""
    cosine: float | None
    """The cosine to the momentum; None without one, or when the update does not point
    against it by enough to need the momentum's norm (cosine >= 0)."""
    scale: float = 1.0
    """The factor the norm bound puts on the update (1: not clipped)."""
    recenter: float | None = None
    """Centered clipping: the factor on the update's deviation from the center (None: none)."""
    center: float = 0.0
    """The coefficient of the momentum in the center (reference norm / momentum norm)."""


class RobustFilter(Journaled):
    """Each author's recent accepted norms; callers hold the replica's lock around it.

    The reference norm is the median over authors of each author's median norm: an author
    floods with one vote, however many updates it publishes. With ``voters`` (the authors with
    a track record, merge.contribution) only their votes count while any of them has a norm
    here. An even count of votes takes the geometric mean of the middle two, so one author of
    two, recording at either end of the band [reference / k, reference * k], settles the
    reference at k times (or 1/k of) the other's instead of dragging it to 0 or off for good.
    """

    def __init__(self, config: RobustConfig) -> None:
        self.config = config
        self._norms: OrderedDict[str, deque[float]] = OrderedDict()
        self._medians: dict[str, float] = {}
        self._rounds: dict[str, int] = {}
        """Each author's applied rounds since its last applied flush (at most `window`)."""

    def __len__(self) -> int:
        """Norms in the window (of all authors)."""
        return sum(len(n) for n in self._norms.values())

    def judge(
        self,
        pseudo_gradient: torch.Tensor,
        momentum: torch.Tensor | Sequence[torch.Tensor] | None,
        norm: float | None = None,
        *,
        voters: Callable[[str], bool] | None = None,
        fresh: bool = False,
        spans: int = 1,
    ) -> Verdict:
        """The verdict on one decoded, finite update (of ``norm``, when the caller has it);
        pure: it changes no state. ``fresh``: its author has no track record (a tighter
        centered-clipping radius). ``spans``: the rounds a flush's residual spans (`spans`),
        which multiply its centered-clipping radius when its norm is within the bound; 1 for
        a round's update.

        ``momentum`` is the direction the swarm has been moving in, or parts that sum to it
        (the outer optimizer's momentum and the shares not yet folded into it): the update's
        dot product with it is the sum of its dot products with the parts, so the sum itself
        is never materialised. The momentum's norm is computed only when a check needs it.
        """
        if norm is None:
            norm = float(torch.linalg.vector_norm(pseudo_gradient))
        parts = _parts(momentum)
        dot = _dot(pseudo_gradient, parts) if parts and norm > 0 else None
        return self.decide(
            norm, dot, lambda: _momentum_norm(parts), voters=voters, fresh=fresh, spans=spans
        )

    def decide(
        self,
        norm: float,
        dot: float | None,
        momentum_norm: Callable[[], float],
        *,
        voters: Callable[[str], bool] | None = None,
        fresh: bool = False,
        spans: int = 1,
    ) -> Verdict:
        """The verdict from the update's statistics alone (`judge` without tensors): its
        ``norm``, its ``dot`` product with the momentum (None without a momentum, or for a
        zero update) and the momentum's norm, asked for only when a check needs it. Each is a
        sum of per-shard sums (squared norms, dot products), so a group whose members each
        hold one shard of the update decides as a replica holding all of it
        (merge.shard_round). Pure."""
        median = self.median_norm(voters)
        bound = self.config.max_norm_to_median
        scale = 1.0
        if median is not None and bound > 0 and norm > bound * median:
            scale = bound * median / norm
        cosine = None
        if dot is not None and (scale < 1 or not (dot >= 0 and self.config.min_cosine < 0)):
            cosine = _cosine_of(dot, norm, momentum_norm())  # cos >= 0 > min_cosine needs none
        if cosine is not None and cosine < self.config.min_cosine:
            return Verdict("against_momentum", norm, median, cosine)
        reason = "norm_outlier" if scale < 1 else None
        radius = self.config.fresh_center_radius if fresh else self.config.center_radius
        if scale == 1:  # a flush within the norm bound: the deviation of its rounds together
            radius *= max(1, spans)
        if median is None or dot is None or radius == 0 or median == 0:
            return Verdict(reason, norm, median, cosine, scale)
        recentered = _recenter(norm * scale, dot * scale, median, radius * median, momentum_norm)
        if recentered is None:
            return Verdict(reason, norm, median, cosine, scale)
        return Verdict(reason or "off_center", norm, median, cosine, scale, *recentered)

    def clipped(
        self, pseudo_gradient: torch.Tensor, momentum: Sequence[torch.Tensor], verdict: Verdict
    ) -> torch.Tensor:
        """The update as the verdict lets it through (a new tensor when centered-clipped;
        the update itself otherwise, its norm bound left to the caller's weight)."""
        if verdict.recenter is None:
            return pseudo_gradient
        out = torch.mul(pseudo_gradient, verdict.scale * verdict.recenter)
        for part in momentum:
            out.add_(part, alpha=(1.0 - verdict.recenter) * verdict.center)
        return out

    def accepted(self, verdict: Verdict, author: str = "") -> None:
        """Records the norm of an update that was applied."""
        self._journal("accepted", verdict, author)
        self._accept(verdict, author)

    def _accept(self, verdict: Verdict, author: str) -> None:
        norms = self._norms.pop(author, None) or deque(maxlen=self.config.window)
        self._norms[author] = norms  # the most recently recorded author last
        norms.append(verdict.norm)
        self._medians[author] = statistics.median(norms)
        if len(self._norms) > MAX_AUTHORS:
            oldest, _ = self._norms.popitem(last=False)
            del self._medians[oldest]
            self._rounds.pop(oldest, None)

    def spans(self, author: str) -> int:
        """The rounds a flush of `author` would span now: its applied rounds since its last
        applied flush, in [1, window] (1 also without any: judged as a round's update)."""
        return max(1, self._rounds.get(author, 0))

    def flushed(self, author: str) -> None:
        """An applied flush of `author` sent its residual: its next flush spans only the
        rounds after this one (called for every applied flush, whatever it moved)."""
        self._journal("flushed", author)
        self._rounds.pop(author, None)

    def record(self, verdict: Verdict, author: str = "", *, flush: bool = False) -> None:
        """Records what an applied update contributed: its norm clamped into the band
        [reference / k, reference * k] (k = max_norm_to_median); one against the momentum
        (zeroed) records nothing.

        Clamped from above, a clipped update moves the reference no further than an unclipped
        one could (recording only unclipped norms froze the bound once honest norms outgrew
        it: bench.slowlink, sparse with 4 fragments). Clamped from below, a flood of zero
        updates records a fraction of the reference, never 0: before, one author's 32 zero
        updates made the median 0, every honest update was clipped to nothing and recorded as
        0, and the swarm never recovered (issue 20). The pipeline now records only updates
        that moved the replica (weight > 0): zeros and budget-cut updates take no share of
        the window at all (one author of zeros beside one other still settled the reference
        at a quarter of the other's norms through the clamp).

        A round (not a ``flush``) also counts as one more round its author's next flush
        spans (`spans`); a flush's norm enters the window as a round's does.
        """
        self._journal("record", verdict, author, flush=flush)
        if verdict.reason == "against_momentum":
            return
        norm, k = verdict.norm, self.config.max_norm_to_median
        if verdict.median_norm is not None and k > 0:
            norm = min(max(norm, verdict.median_norm / k), verdict.median_norm * k)
        self._accept(replace(verdict, norm=norm), author)
        if not flush:  # a round: one more that its author's next flush spans
            self._rounds[author] = min(self._rounds.get(author, 0) + 1, self.config.window)

    def median_norm(self, voters: Callable[[str], bool] | None = None) -> float | None:
        """The reference norm, or None during warm-up (fewer than `warmup` norms held by the
        voting authors)."""
        authors = [a for a in self._norms if voters(a)] if voters is not None else []
        if not authors:
            authors = list(self._norms)
        if sum(len(self._norms[a]) for a in authors) < self.config.warmup:
            return None
        return _middle(sorted(self._medians[a] for a in authors))

    def state_dict(self) -> dict[str, object]:
        """Each author's norms, oldest author first, as parallel lists; and the rounds since
        each author's last flush (`spans`), as parallel lists."""
        authors = [a for a, norms in self._norms.items() for _ in norms]
        return {
            "norms": [n for norms in self._norms.values() for n in norms],
            "authors": authors,
            "round_authors": list(self._rounds),
            "rounds": list(self._rounds.values()),
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restores what state_dict saved; a state of the earlier format (one window of norms,
        no authors) loads as one anonymous author's."""
        norms = state.get("norms")
        if not isinstance(norms, list) or not all(
            isinstance(n, float) and math.isfinite(n) and n >= 0 for n in norms
        ):
            raise ValueError("robust state 'norms' must be a list of finite norms.")
        authors = state.get("authors", [""] * len(norms))
        if not isinstance(authors, list) or len(authors) != len(norms):
            raise ValueError("robust state 'authors' must name the author of every norm.")
        if not all(isinstance(a, str) for a in authors) or len(set(authors)) > MAX_AUTHORS:
            raise ValueError(f"robust state must name at most {MAX_AUTHORS} authors.")
        fresh = RobustFilter(self.config)
        for author, norm in zip(authors, norms, strict=True):
            fresh.accepted(Verdict(None, norm, None, None), author)
        fresh._rounds = self._loaded_rounds(state, set(fresh._norms))
        self._norms, self._medians, self._rounds = fresh._norms, fresh._medians, fresh._rounds
        self._journal_reset()

    def _loaded_rounds(self, state: dict[str, object], authors: set[str]) -> dict[str, int]:
        """The rounds since each author's last flush from a state (none in a state saved
        before flushes were judged apart); only authors with norms in the window."""
        names, counts = state.get("round_authors", []), state.get("rounds", [])
        if not isinstance(names, list) or not isinstance(counts, list):
            raise ValueError("robust state 'round_authors' and 'rounds' must be lists.")
        if len(names) != len(counts) or len(set(names)) != len(names):
            raise ValueError("robust state must name each author of 'rounds' once.")
        window = self.config.window
        if not all(type(c) is int and 0 <= c <= window for c in counts):
            raise ValueError(f"robust state 'rounds' must be integers in [0, {window}].")
        if not all(isinstance(a, str) and a in authors for a in names):
            raise ValueError("robust state 'rounds' may only name authors of its norms.")
        return dict(zip(names, counts, strict=True))


def _middle(values: list[float]) -> float:
    """The median of sorted `values`; of an even count, the geometric mean of the middle two."""
    n = len(values)
    if n % 2:
        return values[n // 2]
    return math.sqrt(values[n // 2 - 1] * values[n // 2])


def _recenter(
    norm: float, dot: float, reference: float, radius: float, momentum_norm: Callable[[], float]
) -> tuple[float, float] | None:
    """Centered clipping (Karimireddy et al. 2021): the update g (of `norm`, `dot` with the
    momentum m) deviates from the center c = reference * m / |m| by |g - c|; beyond `radius`,
    the deviation is scaled to it. Returns (factor on the deviation, reference / |m|), or None
    when the update is within the radius (decided without |m| where the bound settles it)."""
    if dot >= 0 and norm * norm + reference * reference <= radius * radius:
        return None
    m_norm = momentum_norm()
    if m_norm == 0 or not math.isfinite(m_norm):
        return None
    squared = norm * norm + reference * reference - 2.0 * reference * dot / m_norm
    deviation = math.sqrt(max(0.0, squared))
    if deviation <= radius:
        return None
    return radius / deviation, reference / m_norm


def _parts(momentum: torch.Tensor | Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
    if momentum is None:
        return []
    return [momentum] if isinstance(momentum, torch.Tensor) else list(momentum)


def _dot(g: torch.Tensor, parts: list[torch.Tensor]) -> float:
    """<g, sum(parts)> as a sum of dot products: one pass over each part, no temporary."""
    return math.fsum(float(torch.dot(g, part)) for part in parts)


def _momentum_norm(parts: list[torch.Tensor]) -> float:
    """|sum(parts)|: of the one part, or from the parts' pairwise dot products."""
    return float(torch.linalg.vector_norm(parts[0])) if len(parts) == 1 else _norm_of_sum(parts)


def _cosine_of(dot: float, g_norm: float, m_norm: float) -> float | None:
    """The cosine from the dot product and the momentum's norm; None when that is zero or
    not finite."""
    if m_norm == 0 or not math.isfinite(m_norm):
        return None
    return dot / g_norm / m_norm  # not over their product, which can underflow to 0


def _norm_of_sum(parts: list[torch.Tensor]) -> float:
    """|sum(parts)| from the parts' pairwise dot products: no model-sized temporary."""
    squared = math.fsum(
        (1.0 if i == j else 2.0) * float(torch.dot(parts[i], parts[j]))
        for i in range(len(parts))
        for j in range(i, len(parts))
    )
    if math.isfinite(squared) and squared > 1e-30:
        return math.sqrt(squared)
    # Squares that under- or overflow: the norm of the materialised sum, which torch scales.
    return float(torch.linalg.vector_norm(torch.stack(parts).sum(0)))


SUBSTANTIAL = 0.5
"""An update whose norm (as let through) is at least this share of the reference norm is a
whole update's substance; honest norms stay within ~2x of the median."""


SPECK = 0.01
"""An update let through at less than this share of the reference norm is a speck: it takes
that little of the outer round (`round_share`). An honest round of few steps is far above it
and keeps its whole share, its weight already counting its tokens: measured in
tests/swarm/test_hetero.py, a learner three times slower fitting 1-3 steps into a round of the
others' 10 sends 0.035 of the median norm and more."""


def round_share(verdict: Verdict) -> float:
    """The share of its outer round an applied update may take, in [0, 1]: 0 for zeros (a
    flood of valid zero updates let through at the budget's rate would otherwise fold the
    momentum several times per honest update), in proportion below SPECK x the reference
    norm, 1 above it and without a reference."""
    if verdict.reason == "against_momentum" or verdict.norm == 0:
        return 0.0
    if not verdict.median_norm:
        return 1.0
    ratio = verdict.norm * verdict.scale / verdict.median_norm / SPECK
    return min(1.0, max(0.0, ratio))


def substance(verdict: Verdict) -> float:
    """How much of an honest-sized update the applied one is, in [0, 1]: its norm as let
    through (clipped) over SUBSTANTIAL x the reference norm; 0 when zeroed or all zero; 1
    for any other without a reference (none yet, or 0).
    A track record is earned in proportion (merge.contribution): publishing zeros, or specks,
    as fast as the budget lets through earns none, so a flooder never becomes an established
    learner that raises the divisor of honest updates or earns a larger budget."""
    if verdict.reason == "against_momentum" or verdict.norm == 0:
        return 0.0
    if not verdict.median_norm:  # no reference yet, or one a flood of zeros set to 0
        return 1.0
    ratio = verdict.norm * verdict.scale / verdict.median_norm / SUBSTANTIAL  # no underflow to 0
    return min(1.0, max(0.0, ratio))
