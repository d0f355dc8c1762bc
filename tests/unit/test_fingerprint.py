"""The printed join command reproduces the fingerprint; a refusal names what differs."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from node.builders import build_run_spec
from node.cli import build_parser
from node.config import JoinConfig, dataclass_from_args
from node.data import load_corpus
from node.fingerprint import describe_differences, fingerprint_settings, join_arguments

CORPUS = load_corpus(str(Path(torch.__file__).parent / "functional.py"))


def _config(*args: str) -> JoinConfig:
    parsed = build_parser().parse_args(["join", *args])
    return dataclass_from_args(JoinConfig, parsed)  # type: ignore[no-any-return]


def test_joining_with_the_printed_arguments_reproduces_the_fingerprint() -> None:
    node = _config(
        "--run-id", "lab", "--model", "tiny", "--seed", "3", "--inner-steps", "50",
        "--batch-size", "4", "--outer-lr", "0.55", "--staleness", "hinge",
        "--staleness-b", "2", "--token-weighting", "none", "--outer-optimizer", "nesterov",
        "--org", "acme", "--threads", "2", "--port", "0", "--max-rounds", "7",
    )  # fmt: skip
    args = join_arguments(fingerprint_settings(node, CORPUS))
    joiner = _config(*args)
    assert build_run_spec(joiner, CORPUS).fingerprint == build_run_spec(node, CORPUS).fingerprint
    for local_only in ("--org", "--threads", "--port"):
        assert local_only not in args, f"{local_only} is not part of the run"
    assert build_run_spec(_config(), CORPUS).fingerprint != build_run_spec(node, CORPUS).fingerprint


def test_default_settings_print_only_the_run_and_the_model() -> None:
    """The default --model auto prints the model it picked on this machine, never 'auto':
    a joiner on other hardware must train the same model."""
    picked = _config().model
    assert JoinConfig.model == "auto" and picked != "auto"
    assert join_arguments(fingerprint_settings(_config(), CORPUS)) == [
        "--run-id", "diloco-default", "--model", picked,
    ]  # fmt: skip


def test_a_refusal_names_each_differing_setting() -> None:
    swarm = fingerprint_settings(_config("--model", "tiny", "--outer-lr", "0.5"), CORPUS)
    ours = fingerprint_settings(_config("--model", "tiny", "--inner-steps", "50"), CORPUS)
    text = describe_differences(json.dumps({"settings": swarm}), ours)
    assert text == "inner_steps: swarm 100, yours 50; outer_lr: swarm 0.5, yours 0.7"
