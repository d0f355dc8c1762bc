"""Contribution budgets: no author moves the replica by more than its fair share of a round.

In an open swarm anyone may publish valid, signed updates as fast as it likes and mint keys.
Every applied update is 1/M of a round (merge.outer, M its effective learner count). This
ledger credits each applied update with a share f/M, f in [0, 1] its *allowance*, and keeps
per author:

- ``load``: its credited shares, each in fair loads (over budget_rounds / (M - 1), the steady
  load of an author at 1/M of each round, M the update's learner count: so a founder's load
  does not jump against its cap when the swarm grows), decayed exponentially (time constant
  `budget_rounds`) along the author's own clock: the swarm's clock (the progress credited to
  *trusted* authors, in rounds; everyone's while none is trusted) less its own part.
  Publishing faster does not advance one's own clock, so it buys no budget, and keys not yet
  trusted advance no one's;
- ``record``: its credited updates (the sum of f, each times the share of its learner claim
  the replica's evidence bears out and its substance, merge.robust.substance: see `applied`),
  never decayed: its track record here. Zero updates earn none.

An update is allowed what fits under the cap ``c`` fair loads, ``c`` times what an author
publishing 1/M of every round accrues in steady state (1/(M - 1) of a round per round of the
others' progress): f = (cap - load) / (its share in fair loads), clamped to [0, 1]. The
factor c is `fresh_share` for a new author and, once it is established, grows linearly with
its tenure (the others' progress since its first credited update, in rounds of a swarm of
M learners: times M / (M - 1)) to `max_share` over `trust_rounds`: honest learners differ in
speed, and trust is built from history.

Authors credited fewer than `min_record` updates, or present for fewer than `min_tenure`
rounds of the others' progress, are *fresh*: together they share one more budget of
``cohort_share`` fair shares (a cohort with its own clock, its load counted in shares; fresh
keys count as no learner, merge.learners), so minting keys buys no more than one author's
worth; a key earns its own budget by being credited `min_record` updates, which at the
cohort's rate costs Sybils time linear in their number. While no author is established (a
swarm's first updates, or a replica restored from a checkpoint without this ledger) there is
no cohort budget: the first authors make the swarm, and they (founders, see `in_cohort`) keep
their own budgets until they are established.

An author alone is the swarm and has no one to take a share from: an update sized by one
learner (the learner floor found no other author claiming more), or one signed
`alone_after_s` after every other author's latest applied update (a node whose only peer died
or is partitioned away, while the floor still remembers the peer), is allowed whole, adds no
load, earns no record (no one is there to trust it) and advances no one's clock. Signed times
are the author's word, but a receiver refuses an update dated more than the merge's
`max_clock_skew_s` ahead of its own clock: `alone_after_s` (3x that skew, from the pipeline)
is chosen so a flooder cannot date itself alone while honest learners publish more often than
every `alone_after_s - max_clock_skew_s` seconds.

A learner group's update (merge.group_pipeline) is charged to its co-signers, not to its
group key, which changes at every regrouping (`group_allowance`, `group_applied`): each of
its g co-signers 1/(g M) of a round, a solo learner's share in a swarm of g M; the update is
allowed what its median co-signer's account allows; a group most of whose co-signers are
fresh also draws on the fresh cohort, as one fresh author, and its fresh co-signers share
one update's record (docs/scale.md, session 21).

Pure, deterministic and counted in credited shares of applied updates (no clocks): replicas
that applied the same updates in the same order hold the same ledger; in another order they
differ only for authors at their cap (a flood), whose allowances are what the order changed.
Transitions (established, trusted, in the cohort) are set with margins so that an honest
author is never at a cap while it crosses one: which update crosses it follows the order
(tests/unit/test_arrival_order.py).
Not thread-safe: the pipeline calls it under the replica lock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection

from merge.budget_account import Account
from merge.budget_config import BudgetConfig
from merge.weighing_journal import Journaled

FRESH = ""
"""The key of the fresh cohort's budget (no author's id is empty)."""
MAX_AUTHORS = 4096
"""Authors the ledger tracks; beyond, those with the least record are forgotten first."""


class ContributionLedger(Journaled):
    """Per-author budgets and track records, from the updates this replica applied."""

    def __init__(
        self, config: BudgetConfig | None = None, *, alone_after_s: float = math.inf
    ) -> None:
        self.config = config or BudgetConfig()
        if not alone_after_s > 0:  # also refuses NaN
            raise ValueError(f"alone_after_s must be > 0, got {alone_after_s!r}.")
        self.alone_after_s = alone_after_s
        """Signed seconds of every other author's silence after which an author is alone."""
        self._accounts: dict[str, Account] = {}
        self._total = 0.0
        """The swarm's clock: credited shares of trusted authors' updates (rounds)."""

    def __len__(self) -> int:
        return len(self._accounts) - (FRESH in self._accounts)

    def record(self, author: str) -> float:
        """Credited updates of `author` (its track record here)."""
        account = self._accounts.get(author) if author != FRESH else None
        return account.record if account else 0.0

    def is_established(self, author: str) -> bool:
        """Credited `min_record` updates over at least `min_tenure` rounds of the others."""
        account = self._accounts.get(author) if author != FRESH else None
        return (
            account is not None
            and account.record >= self.config.min_record
            and account.tenure(self._total) >= self.config.min_tenure
        )

    def individually_counted(self) -> Callable[[str], bool]:
        """Whether an author's learner claim votes on its own (merge.learners) rather than in
        the fresh cohort: established or a founder, or, while no author is established,
        credited one whole update's worth of record (a key claiming far more learners than
        are seen earns it slowly).
        One predicate for one decision: whether anyone is established is looked up once."""
        if self.any_established():
            return lambda author: self.is_established(author) or self.is_founder(author)
        return self.has_substance

    def has_substance(self, author: str) -> bool:
        """Credited one whole update's worth of record (of an honest update's substance and a
        claim the replica bears out): a zero flooder never has."""
        return self.record(author) >= 1.0

    def any_established(self) -> bool:
        return any(self.is_established(a) for a in self._accounts)

    def in_cohort(self, author: str) -> bool:
        """Whether the author's updates count against the fresh cohort's budget: some author
        is established and this one is not, and is no founder (`is_founder`)."""
        if not self.any_established() or self.is_established(author):
            return False
        return not self.is_founder(author)

    def is_founder(self, author: str) -> bool:
        """Not established yet, its first update credited within the swarm's first
        `min_tenure` rounds (before anyone could be established), a whole update's substance
        since, and present for less than twice `min_tenure`: it keeps its own `fresh_share`
        cap and its vote on the learner floor while its co-founders are established. Founders
        reach their record and tenure a few updates apart, and which of them was established
        first (the others then cut to shares of the cohort's budget, and their claims off the
        floor) followed the order their updates came in (bench.scale drift). A key of zeros
        from the swarm's first update on has no substance: it is pooled."""
        account = self._accounts.get(author) if author != FRESH else None
        if account is None or self.is_established(author):
            return False
        tenure, bound = account.tenure(self._total), self.config.min_tenure
        return account.since < bound and tenure < 2 * bound and account.record >= 1.0

    def allowance(self, author: str, learners: int, created_at: float | None = None) -> float:
        """The share in [0, 1] of an update sized by `learners` and signed at `created_at`
        that `author` may still contribute; pure."""
        if self.config.max_share == 0 or author == FRESH:
            return 1.0
        if self.is_alone(author, learners, created_at):
            return 1.0
        share, tau = 1.0 / learners, self.config.budget_rounds
        fair = _fair(learners, tau)
        allowed = self._room(author, self.cap(author, learners)) / (share / fair)
        if self.in_cohort(author):  # the cohort's load is in shares (see `applied`)
            allowed = min(allowed, self._room(FRESH, self.config.cohort_share * fair) / share)
        return min(1.0, max(0.0, allowed))

    def is_alone(self, author: str, learners: int, created_at: float | None = None) -> bool:
        """Whether `author` is the swarm: its update is sized by one learner, or signed
        `alone_after_s` after every other author's latest applied update."""
        if learners == 1:
            return True
        if created_at is None or not math.isfinite(created_at):
            return False
        others = [acc.seen_at for a, acc in self._accounts.items() if a not in (author, FRESH)]
        if 0.0 in others:  # an author of a state saved before signed times were kept
            return False
        return created_at - max(others, default=-math.inf) > self.alone_after_s

    def cap(self, author: str, learners: int) -> float:
        """The author's cap in fair shares: `fresh_share` until it is established, then
        growing with its tenure to `max_share`. Tenure counts rounds of the swarm sized by
        `learners`: the others' progress is (M - 1)/M of each (a learner 3x as fast as the
        only other one needs a cap of 3 and reaches it within ~10 of the other's rounds)."""
        config = self.config
        base = min(config.fresh_share, config.max_share)
        if not self.is_established(author):
            return base
        tenure = self._accounts[author].tenure(self._total) * learners / max(1, learners - 1)
        trusted = min(1.0, tenure / config.trust_rounds) if config.trust_rounds > 0 else 1.0
        return base + (config.max_share - base) * trusted

    def is_trusted(self, author: str) -> bool:
        """Established, and present for `trust_rounds` of the others' progress, or for as
        long as the swarm had progressed when it came if that is less (its founders: at once):
        its updates advance the swarm's clock. Newer keys' do not, so colluding new keys
        cannot speed up each other's budgets. Half the swarm's clock was the bound before:
        two founders each sit at about half of it, so which of them was trusted (and so how
        fast the clock ran) flipped with the order of their updates (bench.scale drift)."""
        if not self.is_established(author):
            return False
        account = self._accounts[author]
        return account.tenure(self._total) >= min(self.config.trust_rounds, account.since)

    def _clocks(self, author: str) -> bool:
        """Whether the author's updates advance the swarm's clock: trusted authors' do, and
        everyone's while none is trusted (a swarm's first updates)."""
        if any(self.is_trusted(a) for a in self._accounts):
            return self.is_trusted(author)
        return True

    def _room(self, key: str, cap: float) -> float:
        account = self._accounts.get(key)
        return cap - (account.load_at(self._total, self.config.budget_rounds) if account else 0)

    def applied(
        self,
        author: str,
        learners: int,
        allowance: float,
        created_at: float | None = None,
        evidence: float = 1.0,
    ) -> None:
        """An update of `author` sized by `learners`, signed at `created_at`, was applied with
        `allowance`. `evidence` in [0, 1]: the share of its learner claim the replica bears
        out (the learner floor over the claim): a key claiming 1,024 learners where a few
        authors are seen makes each update cheap for its budget, and earns as little record."""
        self._journal("applied", author, learners, allowance, created_at, evidence)
        if author == FRESH:
            return
        share, tau = 1.0 / learners, self.config.budget_rounds
        fair = _fair(learners, tau)
        loaded = not self.is_alone(author, learners, created_at)
        clocked = loaded and self._clocks(author)  # alone, it is not the others' time either
        if loaded and self.in_cohort(author):
            account = self._accounts.setdefault(FRESH, Account())
            account.credit(share, allowance, self._total, tau, clocked=clocked)
        account = self._accounts.setdefault(author, Account())
        evidence = min(1.0, max(0.0, evidence))
        # Alone, there is no one to earn trust from: a stranger that publishes before anyone
        # else (sized by one learner) must not be established when the founders arrive.
        evidence = evidence if loaded else 0.0
        account.credit(
            share, allowance, self._total, tau,
            clocked=clocked, loaded=loaded, evidence=evidence, fair=fair,
        )  # fmt: skip
        if created_at is not None and math.isfinite(created_at):
            account.seen_at = max(account.seen_at, created_at)
        self._total += share * allowance if clocked else 0.0
        if len(self) > MAX_AUTHORS:
            self._forget_least_recorded()

    def group_allowance(self, cosigners: Collection[str], learners: int) -> float:
        """The share in [0, 1] of a learner group's update sized by `learners` (groups) and
        co-signed by `cosigners` that the group may still contribute; pure.

        The budget is held by the members, which survive a regrouping (every group key changes
        when the split's bits do): each of the g co-signers is charged 1/(g M) of a round (a
        solo learner's share in a swarm of g M), and the update is allowed what its median
        co-signer's account allows (the upper median: held back only when most co-signers
        are; a group of two, one of them a newcomer, is not held to the newcomer's cap). A
        group most of whose co-signers are fresh (`in_cohort`) is held to the fresh cohort's
        budget as well, charged there as one fresh solo author publishing 1/M of a round
        (`group_applied`): fresh keys ground into one group buy no more than one fresh key,
        whatever their number. A group of one learner (M = 1) is the swarm: allowed whole."""
        members = _members(cosigners)
        if self.config.max_share == 0 or not members or learners == 1:
            return 1.0
        each, tau = len(members) * learners, self.config.budget_rounds
        unit = 1.0 / each / _fair(each, tau)  # one member's charge, in its fair loads
        own = sorted(self._room(m, self.cap(m, each)) / unit for m in members)
        allowed = own[len(members) // 2]
        if 2 * len(self._fresh_members(members)) > len(members):
            cohort = self._room(FRESH, self.config.cohort_share * _fair(learners, tau))
            allowed = min(allowed, cohort * learners)
        return min(1.0, max(0.0, allowed))

    def group_applied(
        self, cosigners: Collection[str], learners: int, allowance: float, evidence: float = 1.0
    ) -> None:
        """A learner group's update sized by `learners`, co-signed by `cosigners`, was applied
        with `allowance`: each co-signer's account charged 1/(g M) of a round times it, the
        fresh cohort 1/M times it when most co-signers are fresh (`group_allowance`), the
        swarm's clock advanced by its trusted members' part. Each established co-signer earns
        `allowance` times `evidence` of record (as `applied`); the fresh ones share that much
        (each 1/k of it, k of them): keys ground into a group earn their record together no
        faster than one fresh solo key, and an honest newcomer beside established members
        earns a whole update's record a round. Every member is credited against the clock as
        it was before the update, so the order of the co-signers changes nothing."""
        self._journal("group_applied", tuple(cosigners), learners, allowance, evidence)
        members = _members(cosigners)
        if not members:
            return
        each, tau = len(members) * learners, self.config.budget_rounds
        share, fair, loaded = 1.0 / each, _fair(each, tau), learners != 1
        fresh = set(self._fresh_members(members))
        anyone_trusted = any(self.is_trusted(a) for a in self._accounts)
        clocked = {m: loaded and (self.is_trusted(m) or not anyone_trusted) for m in members}
        total = self._total
        evidence = min(1.0, max(0.0, evidence)) if loaded else 0.0
        if loaded and 2 * len(fresh) > len(members):
            cohort = self._accounts.setdefault(FRESH, Account())
            cohort.credit(1.0 / learners, allowance, total, tau, clocked=False)  # members clock
        for member in members:
            account = self._accounts.setdefault(member, Account())
            earned = evidence / len(fresh) if member in fresh else evidence
            account.credit(
                share, allowance, total, tau,
                clocked=clocked[member], loaded=loaded, evidence=earned, fair=fair,
            )  # fmt: skip
        self._total += share * allowance * sum(clocked.values())
        while len(self) > MAX_AUTHORS:
            self._forget_least_recorded()

    def bound_record(self, author: str, limit: float) -> None:
        """Cuts `author`'s record to `limit`: a learner group's update withdrawn as proven
        equivocation (merge.group_pipeline) takes its co-signers' credit back in the co-sign
        ledger, and their records here stay within what they applied and co-signed, as a
        handover checks (merge.handover). Loads charged stay charged; an author left with
        nothing applied or co-signed (`limit` 0) loses its account, as a stranger has none."""
        self._journal("bound_record", author, limit)
        account = self._accounts.get(author) if author != FRESH else None
        if account is not None and limit <= 0:
            del self._accounts[author]
        elif account is not None:
            account.record = min(account.record, limit)

    def _fresh_members(self, members: list[str]) -> list[str]:
        """The members whose updates count against the fresh cohort (`in_cohort`), whether
        anyone is established looked up once."""
        if not self.any_established():
            return []
        return [m for m in members if not self.is_established(m) and not self.is_founder(m)]

    def _forget_least_recorded(self) -> None:
        authors = (a for a in self._accounts if a != FRESH)
        del self._accounts[min(authors, key=lambda a: (self._accounts[a].record, a))]

    def state_dict(self) -> dict[str, object]:
        """Plain JSON types (it travels in state transfers and checkpoints)."""
        return {
            "total": self._total,
            "accounts": [
                [a, acc.load, acc.clock, acc.own, acc.record, acc.since, acc.seen_at]
                for a, acc in self._accounts.items()
            ],
        }

    def load_state_dict(self, state: object) -> None:
        """Restores what state_dict saved; ValueError (and nothing changed) if malformed."""
        total = state.get("total") if isinstance(state, dict) else None
        rows = state.get("accounts") if isinstance(state, dict) else None
        if not isinstance(total, int | float) or not _is_amount(total):
            raise ValueError("contribution ledger state must hold a finite total >= 0.")
        if not isinstance(rows, list) or len(rows) > MAX_AUTHORS + 1:
            raise ValueError(f"contribution ledger state must list at most {MAX_AUTHORS} accounts.")
        accounts: dict[str, Account] = {}
        for row in rows:
            # Six columns: a state from before seen_at (its authors count as long silent).
            if not (
                isinstance(row, list | tuple) and len(row) in (6, 7) and isinstance(row[0], str)
            ):
                raise ValueError("contribution ledger accounts must be [author, 5 or 6 numbers].")
            if not all(_is_amount(x) for x in row[1:]) or row[0] in accounts:
                raise ValueError("contribution ledger accounts must hold finite amounts >= 0.")
            load, clock, own, record, since, *seen_at = (float(x) for x in row[1:])
            # load and own may exceed record: an update of little substance (zeros) loads
            # its author's budget and earns no record (merge.robust.substance).
            if max(clock, own, since) > total + 1e-9:
                raise ValueError("contribution ledger account exceeds what it was credited.")
            accounts[row[0]] = Account(load, clock, own, record, since, *seen_at)
        self._accounts, self._total = accounts, float(total)
        self._journal_reset()


def budgeted(learners: int, weight: float, allowance: float, limit: int) -> tuple[int, float]:
    """(learners, weight) that apply `allowance` of an update sized by `learners`: it moves
    the replica by that share and advances the outer optimizer's round by no more (1/M' of a
    round with M' = ceil(M / allowance)). Scaling the weight alone left each update of a flood
    a whole 1/M of the round, folding the momentum every M updates. Below 1/`limit` of a
    round: nothing (weight 0)."""
    if allowance >= 1:
        return learners, weight
    if allowance <= learners / limit:
        return learners, 0.0
    stepped = math.ceil(learners / allowance)
    return stepped, weight * allowance * stepped / learners


def _members(cosigners: Collection[str]) -> list[str]:
    """A group update's co-signers, each once, in one order on every replica."""
    return sorted(set(cosigners) - {FRESH})


def _fair(learners: int, tau: float) -> float:
    """The steady load, in shares, of one author publishing 1/M of each round of the others'
    progress ((M - 1)/M of a round): loads are counted in this unit, so an author's load does
    not jump against its cap when the swarm grows (at M = 2 a founder's steady load was 4/3 of
    its fresh cap at M = 3, and its updates were cut until it decayed)."""
    return tau / max(1, learners - 1)


def _is_amount(value: object) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value >= 0  # type: ignore[arg-type, operator]
