"""`join --help` explains itself: each section's flags in a titled group, allowed values shown;
--model auto."""

from __future__ import annotations

import dataclasses

import pytest

from node.cli import build_parser, main
from node.config import JoinConfig
from node.settings import SECTIONS


def test_every_join_flag_is_in_exactly_one_section() -> None:
    fields = {f.name for f in dataclasses.fields(JoinConfig)}
    sectioned = [f.name for cls, _ in SECTIONS.values() for f in dataclasses.fields(cls)]
    assert sorted(sectioned) == sorted(set(sectioned)), "a flag in two sections"
    assert set(sectioned) == fields, f"in no section: {fields - set(sectioned)}"


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
