"""One simulated learner of bench.goodput_sim: its steps wait for its slowest chip, it fails
as one Poisson process, and it restarts or drops the failed host and re-forms. Moved out of
bench/goodput_sim.py unchanged in session 25."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from scipy.special import ndtri

from bench.goodput_config import SimConfig


@dataclass(frozen=True)
class Steps:
    """Steps a learner completed: end times and the chip-seconds of compute behind each."""

    ends: np.ndarray
    chip_s: np.ndarray


class LearnerSim:
    """One learner of `chips` chips: runs steps, fails as a Poisson process, recovers."""

    def __init__(
        self,
        config: SimConfig,
        chips: int,
        rng: np.random.Generator,
        *,
        elastic: bool,
        recovery_s: float | None = None,
    ) -> None:
        """`recovery_s`: an elastic learner's recovery per failure (default: reconfig_s)."""
        self.config = config
        self.chips = chips
        self.rng = rng
        self.elastic = elastic
        self.recovery_s = config.reconfig_s if recovery_s is None else recovery_s
        self.t = 0.0
        self.num_failures = 0
        self._to_failure: float | None = None
        self._repairs: deque[float] = deque()
        self._active = chips

    def run_steps(self, num_steps: int, *, stop_on_failure: bool = False) -> tuple[Steps, bool]:
        """Run `num_steps` steps through any failures; (steps done, whether one failed)."""
        ends: list[np.ndarray] = []
        credits: list[np.ndarray] = []
        failed = False
        while num_steps > 0:
            if self._to_failure is None:
                self._to_failure = self.rng.exponential(self.config.mtbi_s / self._active)
            batch = min(num_steps, int(self._to_failure / self.config.step_s * 1.1) + 8)
            elapsed = np.cumsum(self._step_times(batch))
            done = min(batch, int(np.searchsorted(elapsed, self._to_failure, side="right")))
            ends.append(self.t + elapsed[:done])
            credits.append(np.full(done, self._active * self.config.step_s))
            num_steps -= done
            if done == batch:  # no failure within this batch of steps
                self._to_failure -= float(elapsed[-1])
                self.t += float(elapsed[-1])
                continue
            self.t += self._to_failure
            self._fail()
            failed = True
            if stop_on_failure:
                break
        empty = [np.empty(0)]
        return Steps(np.concatenate(ends or empty), np.concatenate(credits or empty)), failed

    def _step_times(self, num_steps: int) -> np.ndarray:
        """Each step waits for the slowest of the active chips."""
        c = self.config
        if c.speed_cv == 0:
            return np.full(num_steps, c.step_s)
        return c.step_s * np.maximum(0.0, 1.0 + c.speed_cv * self._slowest_z(num_steps))

    def _slowest_z(self, size: int) -> np.ndarray:
        """Exact draws of the maximum of `active` standard normals: Phi^-1(U^(1/n))."""
        tail = -np.expm1(np.log(self.rng.random(size)) / self._active)
        return np.asarray(-ndtri(tail))

    def _fail(self) -> None:
        """The step in flight is lost; the learner restarts or drops the host and re-forms."""
        c = self.config
        self.num_failures += 1
        self._to_failure = None
        if not self.elastic:
            self.t += c.restart_s
            return
        self._repairs.append(self.t + c.repair_s)
        while self._repairs and self._repairs[0] <= self.t:  # repaired hosts rejoin now
            self._repairs.popleft()
        self._active = max(1, self.chips - len(self._repairs) * c.host_chips)
        self.t += self.recovery_s
