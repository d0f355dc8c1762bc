"""Learner groups' settings and heartbeat fields (docs/scale.md, wiring plan step 1): off by
default with the fingerprint of before, flags under their own title in `join --help`, bad
values one line naming the flag; heartbeats of a node with groups off are what older nodes'
strict parser accepts, and the group fields are bounded when sent."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.heartbeat import (
    MAGIC,
    OMITTED_WHEN_NONE,
    OMITTED_WHEN_ZERO,
    Heartbeat,
    HeartbeatError,
    sign_fields,
)
from merge.identity import Identity
from node.builders import build_run_spec, fingerprint_spec
from node.cli import build_parser
from node.config import JoinConfig, config_from_args
from node.data import load_corpus
from node.fingerprint import fingerprint_settings, join_arguments
from node.settings import SECTIONS, GroupSettings

CORPUS = load_corpus(str(Path(torch.__file__).parent / "functional.py"))
PARSER = build_parser()
DEFAULT_TINY_FINGERPRINT = "46220f032a4b866a49f7621afdbb4f4c8aa28e834536bd01050146038733ee3b"


def _join(*argv: str) -> JoinConfig:
    return config_from_args(JoinConfig, PARSER.parse_args(["join", "--model", "tiny", *argv]))


def test_groups_are_off_by_default_and_leave_the_fingerprint_as_it_was() -> None:
    config = _join()
    assert not config.groups_on and config.group_size == 0
    spec = build_run_spec(config, CORPUS)
    assert "groups" not in fingerprint_spec(config, spec.model, spec.merge)
    # the default tiny run's fingerprint before the groups section existed (commit 9ce8057)
    assert spec.fingerprint == DEFAULT_TINY_FINGERPRINT


def test_each_group_setting_changes_the_fingerprint_once_groups_are_on() -> None:
    on = _join("--group-size", "3")
    base = build_run_spec(on, CORPUS).fingerprint
    assert base != DEFAULT_TINY_FINGERPRINT
    for flag, value in [
        ("--group-max-bits", "2"),
        ("--group-epoch-rounds", "4"),
        ("--group-quorum", "0.75"),
        ("--group-max-norm-to-median", "2.5"),
        ("--group-wait", "12"),
    ]:
        other = _join("--group-size", "3", flag, value)
        assert build_run_spec(other, CORPUS).fingerprint != base, flag


def test_the_printed_join_command_carries_the_group_flags() -> None:
    node = _join("--group-size", "3", "--group-wait", "7.5", "--group-quorum", "0.6")
    args = join_arguments(fingerprint_settings(node, CORPUS))
    assert "--group-size" in args and "--group-wait" in args and "--group-quorum" in args
    joiner = config_from_args(JoinConfig, PARSER.parse_args(["join", *args]))
    assert build_run_spec(joiner, CORPUS).fingerprint == build_run_spec(node, CORPUS).fingerprint


def test_the_section_builds_the_pure_configs() -> None:
    config = _join("--group-size", "3", "--group-max-bits", "1", "--group-quorum", "0.6")
    assert config.grouping_config().min_group_size == 3
    assert config.grouping_config().max_bits == 1
    assert config.reduction_config().quorum_share == 0.6
    assert SECTIONS["groups"] == (GroupSettings, "learner groups")


def test_help_shows_the_group_flags_under_their_title(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        PARSER.parse_args(["join", "--help"])
    text = capsys.readouterr().out
    title = text.index("learner groups:")
    assert text.index("outer optimizer and merging:") < title < text.index("network:")
    for flag in ("--group-size", "--group-max-bits", "--group-wait", "--group-quorum"):
        assert title < text.index(flag) < text.index("network:"), flag


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--group-size", "-1"], "--group-size must not be negative, got -1"),
        (
            ["--group-size", "2"],
            "--group-size 2 is refused: in a group of two either member voids the other's"
            " every round (docs/trust.md); use 3 or more",
        ),
        (["--group-max-bits", "17"], "--group-max-bits must be an integer in [0, 16], got 17"),
        (["--group-quorum", "0"], "--group-quorum must be in (0, 1], got 0.0"),
        (["--group-quorum", "1.5"], "--group-quorum must be in (0, 1], got 1.5"),
        (["--group-wait", "0"], "--group-wait must be a positive number, got 0.0"),
    ],
)
def test_a_bad_group_value_is_one_line_naming_its_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        _join(*argv)
    assert str(caught.value) == message


IDENTITY = Identity.generate()


def _body(blob: bytes) -> dict[str, object]:
    (length,) = struct.unpack(">I", blob[4:8])
    assert blob[:4] == MAGIC
    return json.loads(blob[8 : 8 + length])  # type: ignore[no-any-return]


def test_a_heartbeat_with_groups_off_holds_only_the_fields_older_nodes_accept() -> None:
    """Older nodes parse heartbeats strictly (extra="forbid"): a key they do not know is a
    malformed heartbeat. Groups off, the body holds exactly the fields of before."""
    blob = Heartbeat(peer_id=IDENTITY.peer_id, round=3).sign(IDENTITY)
    newer = set(OMITTED_WHEN_NONE) | set(OMITTED_WHEN_ZERO)  # left out at their defaults
    older = {f.name for f in dataclasses.fields(Heartbeat)} - newer
    assert set(_body(blob)) == older
    parsed = Heartbeat.verify(blob, IDENTITY.peer_id)
    assert (parsed.group_bits, parsed.group_epoch) == (None, None)


@settings(max_examples=30, deadline=None)
@given(bits=st.integers(0, 16), epoch=st.integers(0, 2**40))
def test_group_fields_round_trip(bits: int, epoch: int) -> None:
    heartbeat = Heartbeat(peer_id=IDENTITY.peer_id, group_bits=bits, group_epoch=epoch)
    blob = heartbeat.sign(IDENTITY)
    assert _body(blob)["group_bits"] == bits
    assert Heartbeat.verify(blob, IDENTITY.peer_id) == heartbeat


@pytest.mark.parametrize("bad", [{"group_bits": 17}, {"group_bits": -1}, {"group_bits": "3"},
                                 {"group_epoch": -2}, {"group_epoch": 1.5}])  # fmt: skip
def test_a_crafted_group_field_is_a_counted_malformed_heartbeat(bad: dict[str, object]) -> None:
    fields = dataclasses.asdict(Heartbeat(peer_id=IDENTITY.peer_id)) | bad
    blob = sign_fields(fields, IDENTITY)
    with pytest.raises(HeartbeatError) as caught:
        Heartbeat.verify(blob, IDENTITY.peer_id)
    assert caught.value.reason == "malformed"
