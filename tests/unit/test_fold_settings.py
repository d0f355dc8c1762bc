"""--group-fold (docs/scale.md, Session 29): off by default and then absent from the
fingerprint (runs with --group-shard-fetch keep theirs); on, it changes the fingerprint and
travels in the printed join command and the run settings the node's swarm reads; without
the shard fetch it is refused, by the node and by the exchange."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dht.group_exchange import GroupExchange
from merge.identity import Identity
from node.builders import build_run_spec, fingerprint_spec
from node.config import JoinConfig, config_from_args
from node.fingerprint import fingerprint_settings, join_arguments
from tests.unit.test_group_settings import CORPUS, PARSER, _join

FETCH = ("--group-size", "3", "--group-scatter", "--group-shard-fetch")


def test_the_flag_is_off_by_default_and_absent_from_the_fingerprint() -> None:
    config = _join(*FETCH)
    assert not config.group_fold
    spec = build_run_spec(config, CORPUS)
    assert "group_fold" not in fingerprint_spec(config, spec.model, spec.merge)["groups"]


def test_on_it_changes_the_fingerprint_and_joiners_get_it() -> None:
    off, on = _join(*FETCH), _join(*FETCH, "--group-fold")
    assert build_run_spec(on, CORPUS).fingerprint != build_run_spec(off, CORPUS).fingerprint
    settings = fingerprint_settings(on, CORPUS)
    assert settings["group_fold"] is True  # what node.network_swarm reads
    args = join_arguments(settings)
    joiner = config_from_args(JoinConfig, PARSER.parse_args(["join", *args]))
    assert build_run_spec(joiner, CORPUS).fingerprint == build_run_spec(on, CORPUS).fingerprint


def test_the_exchange_refuses_a_fold_without_the_shard_fetch() -> None:
    identity = Identity.generate()
    network = SimpleNamespace(identity=identity, config=SimpleNamespace(run_id="r"))
    with pytest.raises(ValueError, match="needs the shard fetch"):
        GroupExchange(network, numel=8, reject=lambda *_: None, is_alive=bool, fold=True)  # type: ignore[arg-type]
