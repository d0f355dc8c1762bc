"""Which run `join --peers M` without --run-id joins: the one the swarm trains.

Before this, such a node silently started `diloco-default` beside the run its peer trains.
Now: no run in the swarm yet, ours (the default); exactly one, that one with its settings
(each flag given on the command line still wins); several, a one-line error listing them.

The run records come from peers: a setting is adopted only when it is a run-level setting
(never a path, a device, a stopping rule) with a plain value; the parser and JoinConfig then
validate the values as if the user had typed them.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from node.fingerprint import join_arguments
from node.settings import SECTIONS

ADOPTABLE = frozenset(
    field.name
    for section in ("train", "outer", "merge")
    for field in dataclasses.fields(SECTIONS[section][0])
) - frozenset(
    {
        "data", "data_slice", "max_rounds", "max_time", "linger", "linger_until_done",
        "eval_batches", "eval_every", "device", "threads", "nproc_per_node", "parallel",
        "speed_factor",
        "emulated_step_s",
    }
)  # fmt: skip
"""Settings a run record may give a node that joins it (they enter the run fingerprint)."""
_PLAIN_TEXT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/+-]{0,99}")


class RunChoiceError(ValueError):
    """The swarm trains several runs (or one the node cannot read): the user must choose."""


@dataclass(frozen=True)
class SwarmRun:
    """A run the swarm trains, as its record says: id and settings (None: unreadable)."""

    run_id: str
    settings: dict[str, Any] | None

    def join_flags(self) -> list[str]:
        """The flags that join it: --run-id and its other settings."""
        return ["--run-id", self.run_id, *self._setting_flags()]

    def describe(self) -> str:
        if self.settings is None:
            return f"'{self.run_id}' (settings unreadable)"
        return f"'{self.run_id}' ({' '.join(self._setting_flags()) or 'default settings'})"

    def _setting_flags(self) -> list[str]:
        settings = self.settings or {}
        return join_arguments({k: v for k, v in settings.items() if k != "run_id"})


def swarm_run(run_id: str, summaries: list[str]) -> SwarmRun:
    """The run's adoptable settings from its records' summaries (one per configuration seen;
    more than one, or a value that is not plain, leaves them unreadable)."""
    settings = _settings(summaries[0]) if len(summaries) == 1 else None
    if settings is not None and settings.get("run_id", run_id) != run_id:
        settings = None
    return SwarmRun(run_id, settings)


def choose_run(runs: list[SwarmRun]) -> SwarmRun | None:
    """The run to join when none was asked for: None for a swarm with no run yet (start
    ours), the only one; RunChoiceError when there are several or it is unreadable."""
    if not runs:
        return None
    if len(runs) > 1:
        listed = ", ".join(run.describe() for run in sorted(runs, key=lambda r: r.run_id))
        raise RunChoiceError(
            f"the swarm trains {len(runs)} runs: {listed}; choose one with --run-id RUN "
            "(or paste the join command its nodes print)"
        )
    (run,) = runs
    if run.settings is None:
        raise RunChoiceError(
            f"the swarm trains run '{run.run_id}', whose settings cannot be read here; "
            "paste the join command its nodes print"
        )
    return run


def run_id_given(argv: list[str]) -> bool:
    """Whether the join command line names a run (--run-id X or --run-id=X)."""
    return any(arg == "--run-id" or arg.startswith("--run-id=") for arg in argv)


def _settings(summary: str) -> dict[str, Any] | None:
    try:
        parsed = json.loads(summary)
    except ValueError:
        return None
    settings = parsed.get("settings") if isinstance(parsed, dict) else None
    if not isinstance(settings, dict):
        return None
    adopted = {k: v for k, v in settings.items() if k in ADOPTABLE or k == "run_id"}
    return adopted if all(map(_plain, adopted.values())) else None


def _plain(value: object) -> bool:
    if isinstance(value, bool | int | float) or value is None:
        return True
    return isinstance(value, str) and _PLAIN_TEXT.fullmatch(value) is not None
