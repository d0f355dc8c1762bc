"""The node's replica of the global model: flat parameters, outer optimizer, applied set.

A run with fragments (merge.fragments, P > 1) has one outer optimizer per fragment, sized to
it: a fragment update steps that fragment's parameters and momentum only, and its 1/M share
of a round counts towards that fragment's round (Delayed Nesterov folds per fragment).
The params norm and its bounds live in merge.replica_norm, the state_dict, its loading and the
settled params in merge.replica_saved (mixins Replica inherits).
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable, Sequence

import torch

from merge.cosign_ledger import CosignLedger
from merge.envelope import UpdateHeader
from merge.fragments import FragmentLayout
from merge.outer import OuterOptimizer
from merge.replica_norm import NormBounds
from merge.replica_saved import Saved
from merge.weighing_journal import CreditedSum


class Replica(NormBounds, Saved):
    """The global model as this node has merged it; every access goes through ``lock``.

    The replica owns ``params``: the caller must not modify the tensor it passes in. Readers
    that need a consistent copy use :meth:`snapshot`.
    """

    def __init__(
        self,
        params: torch.Tensor,
        outer: OuterOptimizer | Sequence[OuterOptimizer],
        layout: FragmentLayout | None = None,
    ) -> None:
        """``outer``: one optimizer for the whole model, or with ``layout`` one per fragment."""
        if not isinstance(params, torch.Tensor) or params.dim() != 1:
            raise ValueError("replica params must be a 1-D tensor.")
        if params.dtype != torch.float32 or params.device.type != "cpu":
            raise ValueError(f"replica params must be fp32 on CPU, got {params.dtype}.")
        outers = [outer] if isinstance(outer, OuterOptimizer) else list(outer)
        if layout is not None and layout.numel != params.numel():
            raise ValueError(
                f"fragment layout covers {layout.numel} elements, not {params.numel()}."
            )
        sizes = (
            [params.numel()]
            if layout is None
            else [layout.fragment_numel(p) for p in range(layout.num_fragments)]
        )
        if [o.numel for o in outers] != sizes:
            raise ValueError(
                f"outer optimizers are sized for {[o.numel for o in outers]} elements, the "
                f"{'fragments' if layout else 'params'} have {sizes}."
            )
        self.lock = threading.RLock()
        self.params = params.detach()
        self.layout = layout
        self.outers = outers
        """One outer optimizer per fragment (just one without fragments)."""
        self._applied: dict[str, set[int]] = {}
        self._last_seq: dict[str, int] = {}
        self._num_applied = 0
        self.credit = CreditedSum()
        """Applied updates, each counted by the share its author's budget let through
        (merge.contribution): the progress an author's header counts staleness in. Journaled
        with what weighs later updates (merge.weighing_journal: the pipeline attaches it)."""
        self._version = 0
        """Bumped whenever the applied set changes: the cached digest is for one version."""
        self._digest: tuple[int, str] | None = None
        self._norm_bounds: tuple[int, float, float, int] | None = None
        """(params' torch version counter, lo, hi, steps carried): bounds on params_norm()
        while the params are unchanged but for the steps that carried them."""
        self.cosigned = CosignLedger()
        """Per member and group key, the applied group updates it co-signed (its records)."""

    @property
    def numel(self) -> int:
        return self.params.numel()

    @property
    def num_fragments(self) -> int:
        """P: 1 for a replica whose updates are whole-model ones."""
        return 1 if self.layout is None else self.layout.num_fragments

    @property
    def outer(self) -> OuterOptimizer:
        """The outer optimizer of a replica without fragments."""
        if self.layout is not None:
            raise AttributeError("a replica with fragments has one outer optimizer per fragment")
        return self.outers[0]

    def outer_for(self, fragment: int | None) -> OuterOptimizer:
        """The optimizer an update of ``fragment`` steps (None: a whole-model update)."""
        return self.outers[0 if fragment is None else fragment]

    def update_numel(self, fragment: int | None) -> int:
        """Elements of an update of ``fragment`` (None: a whole-model update)."""
        if fragment is None or self.layout is None:
            return self.numel
        return self.layout.fragment_numel(fragment)

    def fragment_params(self, fragment: int) -> tuple[torch.Tensor, int]:
        """A copy of one fragment's params and the number of updates they include."""
        with self.lock:
            if self.layout is None:
                return self.params.clone(), self._progress()
            return self.layout.gather(self.params, fragment), self._progress()

    @property
    def num_applied(self) -> int:
        with self.lock:
            return self._num_applied

    @property
    def progress(self) -> int:
        """Applied updates counted by their credited shares (whole ones): what an author's
        header counts as applied (base_applied, published_applied), so a budget-cut flood, or
        a flood of zeros (no substance, merge.robust.substance), applied during a round does
        not make an honest update stale. Equal to num_applied while no update was cut."""
        with self.lock:
            return self._progress()

    def _progress(self) -> int:
        return math.floor(self.credit.total + 1e-9)

    @property
    def applied(self) -> dict[str, list[int]]:
        """A copy of the applied set: author -> sorted seqs."""
        with self.lock:
            return {author: sorted(seqs) for author, seqs in self._applied.items()}

    def last_seq(self, author: str) -> int:
        """The highest seq applied from ``author``, or -1."""
        with self.lock:
            return self._last_seq.get(author, -1)

    def has_applied(self, author: str, seq: int) -> bool:
        with self.lock:
            return seq in self._applied.get(author, ())

    def apply(
        self,
        header: UpdateHeader,
        pseudo_gradient: torch.Tensor,
        weight: float,
        norm: float | None = None,
        *,
        learners: int | None = None,
        credited: float = 1.0,
        cosigners: Sequence[str] = (),
    ) -> None:
        """Steps the outer optimizer with the update and records its id; sized by `learners`
        (the pipeline's, merge.learners), else by the header's signed count; `credited`: the
        share of it its author's budget let through (it counts that much in :attr:`progress`);
        `cosigners`: a learner group's update's co-signers (credited in :attr:`cosigned`).

        An update of weight 0 contributes nothing: its id is recorded, the params and the outer
        optimizer's state stay as they are. ``norm``: the pseudo-gradient's norm, when the
        caller has it (it keeps :meth:`params_norm_bounds` known through the step).
        """
        with self.lock:
            if self.has_applied(header.author, header.seq):
                raise ValueError(f"update {header.update_id} has already been applied.")
            if (header.fragment is None) != (self.layout is None):
                raise ValueError(
                    f"update {header.update_id} does not fit this replica's fragments."
                )
            self._tag(header)
            if weight != 0:
                if learners is None:
                    learners = 1 if header.learners is None else header.learners
                bounds = self.params_norm_bounds()
                moved = self._step(header, pseudo_gradient, weight, learners)
                self._carry_norm_bounds(bounds, moved, norm)
            self._record(header.author, header.seq)
            self.credit.add(min(1.0, max(0.0, credited)))
            if cosigners:
                self.cosigned.credit(header.author, cosigners)

    def restep(
        self,
        header: UpdateHeader,
        pseudo_gradient: torch.Tensor,
        weight: float,
        norm: float | None = None,
        *,
        learners: int,
        credited: float = 0.0,
        cosigners: Sequence[str] = (),
    ) -> None:
        """Steps with another variant of an applied id whose own step was withdrawn (a learner
        group's prevailing variant in place of a lesser one: merge.equivocation), as `apply`
        would step with it; the applied set stays as it is (the id is applied once), the
        progress grows by `credited` (the lesser's share, taken back with its records: the
        pipeline's weighing journal). The caller checks that the id's step was withdrawn."""
        with self.lock:
            if not self.has_applied(header.author, header.seq):
                raise ValueError(f"update {header.update_id} has not been applied.")
            if (header.fragment is None) != (self.layout is None):
                raise ValueError(
                    f"update {header.update_id} does not fit this replica's fragments."
                )
            self._tag(header)
            if weight != 0:
                outer = self.outer_for(header.fragment)
                self._in_place(header, outer.plain_step if header.flush else outer.put_in,
                               pseudo_gradient, weight, learners)  # fmt: skip
                self._norm_bounds = None
            self.credit.add(min(1.0, max(0.0, credited)))
            if cosigners:
                self.cosigned.credit(header.author, cosigners)

    def _tag(self, header: UpdateHeader) -> None:
        """What the pipeline's weighing journal files the mutations that follow under: this
        update's id (taken back together: merge.weighing_journal)."""
        if self.credit.journal is not None:
            self.credit.journal.tag = header.update_id

    def withdraw(
        self,
        header: UpdateHeader,
        pseudo_gradient: torch.Tensor,
        weight: float,
        learners: int,
        *,
        slot: bool = False,
    ) -> None:
        """Takes back the outer step of an applied update, applied with `weight` and sized by
        `learners` (merge.equivocation); its id stays applied. ``slot``: every term of the
        step linear in the update (OuterOptimizer.take_back), for another variant to step in
        its place (`restep`); else its plain share only (a voided id)."""
        with self.lock:
            if not self.has_applied(header.author, header.seq):
                raise ValueError(f"update {header.update_id} has not been applied.")
            if weight == 0:
                return
            outer = self.outer_for(header.fragment)
            withdraw = outer.take_back if slot else outer.withdraw
            withdraw = outer.withdraw_plain if header.flush else withdraw
            self._in_place(header, withdraw, pseudo_gradient, weight, learners)
            self._norm_bounds = None

    def _in_place(
        self,
        header: UpdateHeader,
        op: Callable[[torch.Tensor, torch.Tensor, float, int], object],
        pseudo_gradient: torch.Tensor,
        weight: float,
        learners: int,
    ) -> None:
        """`op` on the params `header`'s update steps (its fragment's, gathered and back)."""
        if header.fragment is None or self.layout is None:
            op(self.params, pseudo_gradient, weight, learners)
            return
        params = self.layout.gather(self.params, header.fragment)
        op(params, pseudo_gradient, weight, learners)
        self.layout.scatter(self.params, header.fragment, params)

    def _step(
        self, header: UpdateHeader, pseudo_gradient: torch.Tensor, weight: float, learners: int
    ) -> float | None:
        """The outer step (a plain one, no momentum, for a flush: merge.envelope); |a| when
        it moved the params by a * pseudo_gradient alone."""
        outer, fragment = self.outer_for(header.fragment), header.fragment
        step = outer.plain_step if header.flush else outer.step
        if fragment is None or self.layout is None:
            return step(self.params, pseudo_gradient, weight, learners)
        params = self.layout.gather(self.params, fragment)
        step(params, pseudo_gradient, weight, learners)
        self.layout.scatter(self.params, fragment, params)
        return None

    def snapshot(self) -> tuple[torch.Tensor, int]:
        """A copy of the params and the :attr:`progress` they include, taken atomically."""
        with self.lock:
            return self.params.clone(), self._progress()

    def applied_digest(self) -> str:
        """SHA-256 hex of the lexicographically sorted "author:seq\\n" lines of the applied set.

        Cached until the applied set changes: the network loop asks for it on every poll."""
        with self.lock:
            version = self._version
            if self._digest is not None and self._digest[0] == version:
                return self._digest[1]
            lines = sorted(f"{a}:{s}\n" for a, seqs in self._applied.items() for s in seqs)
        digest = hashlib.sha256("".join(lines).encode()).hexdigest()
        with self.lock:
            self._digest = (version, digest)
        return digest

    def _record(self, author: str, seq: int) -> None:
        self._applied.setdefault(author, set()).add(seq)
        self._version += 1
        self._last_seq[author] = max(seq, self._last_seq.get(author, -1))
        self._num_applied += 1
