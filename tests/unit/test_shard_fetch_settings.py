"""--group-shard-fetch (docs/scale.md, Session 17): off by default and then absent from the
fingerprint (runs with --group-scatter keep theirs); on, it changes the fingerprint and
travels in the printed join command and the run settings the node's swarm reads."""

from __future__ import annotations

from node.builders import build_run_spec, fingerprint_spec
from node.config import JoinConfig, config_from_args
from node.fingerprint import fingerprint_settings, join_arguments
from tests.unit.test_group_settings import CORPUS, PARSER, _join

SCATTER = ("--group-size", "3", "--group-scatter")


def test_the_flag_is_off_by_default_and_absent_from_the_fingerprint() -> None:
    config = _join(*SCATTER)
    assert not config.group_shard_fetch
    spec = build_run_spec(config, CORPUS)
    assert "group_shard_fetch" not in fingerprint_spec(config, spec.model, spec.merge)["groups"]


def test_on_it_changes_the_fingerprint_and_joiners_get_it() -> None:
    off, on = _join(*SCATTER), _join(*SCATTER, "--group-shard-fetch")
    assert build_run_spec(on, CORPUS).fingerprint != build_run_spec(off, CORPUS).fingerprint
    settings = fingerprint_settings(on, CORPUS)
    assert settings["group_shard_fetch"] is True  # what node.network_swarm reads
    args = join_arguments(settings)
    joiner = config_from_args(JoinConfig, PARSER.parse_args(["join", *args]))
    assert build_run_spec(joiner, CORPUS).fingerprint == build_run_spec(on, CORPUS).fingerprint
