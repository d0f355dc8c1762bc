"""How long until the round in progress ends, from the pace of its steps so far."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RoundEta:
    """Estimates from the steps seen since the round's first report: the first step's
    start-up (data, compilation, a resumed round's earlier steps) does not skew the pace."""

    _round: int | None = None
    _first_step: int = 0
    _first_at_s: float = 0.0

    def estimate(self, round_: int, step: int, planned_steps: int, now_s: float) -> float | None:
        """Seconds to step `planned_steps` of `round_`; None until two steps were seen."""
        if round_ != self._round or step < self._first_step:
            self._round, self._first_step, self._first_at_s = round_, step, now_s
            return None
        steps_seen, elapsed_s = step - self._first_step, now_s - self._first_at_s
        if steps_seen <= 0 or elapsed_s <= 0:
            return None
        return max(planned_steps - step, 0) * elapsed_s / steps_seen


def format_duration(seconds: float) -> str:
    """0:42, 12:05, 1:02:03."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
