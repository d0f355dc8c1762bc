"""Which of a node's settings make its run fingerprint: for the join command it prints, and
for telling a refused node which settings differ from the swarm's."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import TYPE_CHECKING, Any

from node.config import JoinConfig

if TYPE_CHECKING:
    from node.data import Corpus

ALWAYS = ("run_id", "model")
"""Shown even at their defaults: a join command names the run and the model it trains."""


def fingerprint_settings(config: JoinConfig, corpus: Corpus) -> dict[str, Any]:
    """run_id, model, and every setting that differs from its default and changes the
    fingerprint (found by resetting it: nothing to keep in sync when fields are added)."""
    from node.builders import build_run_spec  # torch: the CLI's parser loads without it

    base = build_run_spec(config, corpus).fingerprint
    settings: dict[str, Any] = {name: getattr(config, name) for name in ALWAYS}
    for f in dataclasses.fields(JoinConfig):
        value = getattr(config, f.name)
        if f.name in ALWAYS or f.default is dataclasses.MISSING or value == f.default:
            continue
        trial = copy.copy(config)  # no __post_init__: only the run spec is computed from it
        setattr(trial, f.name, f.default)
        if build_run_spec(trial, corpus).fingerprint != base:
            settings[f.name] = value
    return settings


def join_arguments(settings: dict[str, Any]) -> list[str]:
    """`settings` as `diloco-node join` flags."""
    args: list[str] = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            args += [flag, *map(str, value)]
        elif value is not None:
            args += [flag, str(value)]
    return args


def describe_differences(theirs: object, ours: dict[str, Any], label: str = "swarm") -> str:
    """`inner_steps: swarm 100, yours 50; ...` from the swarm's run record (or, with `label`,
    another holder's summary {"settings": ...}) and our settings."""
    settings = _settings_of(theirs)
    if settings is None:
        return f"{label} {theirs}, yours {json.dumps(ours, sort_keys=True)}"
    parts = [
        f"{name}: {label} {_show(a)}, yours {_show(b)}"
        for name, (a, b) in settings_differences(settings, ours).items()
    ]
    return "; ".join(parts) or "the same settings, but another version of diloco-node"


def settings_differences(theirs: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    """{name: (theirs, ours)} for each setting that differs (one missing is at its default)."""
    defaults = {f.name: f.default for f in dataclasses.fields(JoinConfig)}
    differences = {}
    for name in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(name, defaults.get(name)), ours.get(name, defaults.get(name))
        if a != b:
            differences[name] = (a, b)
    return differences


def _settings_of(summary: object) -> dict[str, Any] | None:
    try:
        parsed = json.loads(summary) if isinstance(summary, str) else summary
    except ValueError:
        return None
    settings = parsed.get("settings") if isinstance(parsed, dict) else None
    return settings if isinstance(settings, dict) else None


def _show(value: object) -> str:
    return "default" if value is None else str(value)
