"""`join --help` explains itself: flags in titled groups, allowed values shown; --model auto."""

from __future__ import annotations

import dataclasses

import pytest

from node.cli import build_parser, main
from node.config import JoinConfig


def test_every_join_flag_is_in_exactly_one_group() -> None:
    fields = {f.name for f in dataclasses.fields(JoinConfig)}
    grouped = [name for names in JoinConfig.FLAG_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(set(grouped)), "a flag in two groups"
    assert set(grouped) == fields, f"ungrouped: {fields - set(grouped)}"
    assert set(JoinConfig.CHOICES) <= fields


def test_help_shows_the_groups_and_the_allowed_values(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["join", "--help"])
    text = capsys.readouterr().out
    titles = ["training:", "outer optimizer and merging:", "network:", "dashboard:"]
    titles += ["checkpoints:", "logging and tracking:"]
    positions = [text.index(title) for title in titles]
    assert positions == sorted(positions)
    assert text.index("--outer-lr") > text.index("outer optimizer and merging:")
    assert text.index("--checkpoint-every") > text.index("checkpoints:")
    assert "--staleness {constant,polynomial,hinge,exponential}" in text
    assert "--parallel {ddp,fsdp}" in text
    assert "hf:llama-small" in text


def test_a_value_outside_the_choices_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["join", "--staleness", "linear"]) == 1
    error = capsys.readouterr().err
    assert error.strip() == (
        "diloco-node: error: --staleness must be one of constant, polynomial, hinge, "
        "exponential; got 'linear'"
    )


def test_model_auto_picks_tiny_on_a_cpu() -> None:
    assert JoinConfig(model="auto", device="cpu").model == "tiny"
