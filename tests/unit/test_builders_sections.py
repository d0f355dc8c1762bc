"""Each builder reads only the settings sections it is typed with (node/builders.py): a bare
section builds the same part as the whole JoinConfig, so nothing reads a field of another one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.codecs import CODECS
from node.builders import build_run_spec, build_swarm_config, inner_config
from node.config import JoinConfig
from node.data import load_corpus
from node.settings import (
    STALENESS_KINDS,
    MergeSettings,
    NetworkSettings,
    OuterSettings,
    RunSettings,
    TrainSettings,
)

CORPUS = load_corpus(str(Path(torch.__file__).parent / "functional.py"))

run_settings = st.fixed_dictionaries(
    {
        "model": st.sampled_from(["tiny", "small"]),
        "inner_steps": st.integers(1, 500),
        "seed": st.integers(0, 2**31),
        "batch_size": st.none() | st.integers(1, 64),
        "codec": st.sampled_from(sorted(CODECS)),
        "outer_optimizer": st.sampled_from(["nesterov", "delayed_nesterov"]),
        "outer_momentum": st.none() | st.floats(0, 0.99),
        "outer_delay": st.none() | st.integers(1, 64),
        "staleness": st.sampled_from(STALENESS_KINDS),
        "staleness_a": st.floats(0, 4),
        "token_weighting": st.sampled_from(["tokens", "none"]),
        "correction": st.sampled_from(["none", "heloco"]),
        "correction_strength": st.floats(0, 100),
    }
)


@settings(max_examples=40, deadline=None)
@given(run_settings)
def test_the_run_sections_alone_give_the_nodes_fingerprint_and_merge(fields: dict) -> None:
    alone = build_run_spec(RunSettings(**fields), CORPUS)
    node = build_run_spec(JoinConfig(swarm=False, **fields), CORPUS)
    assert alone == node


def test_the_train_section_alone_gives_the_nodes_inner_loop() -> None:
    fields: dict[str, Any] = {"model": "tiny", "max_rounds": 7, "inner_steps": 30}
    assert inner_config(TrainSettings(**fields)) == inner_config(JoinConfig(swarm=False, **fields))


def test_the_network_section_alone_gives_the_nodes_swarm_config(tmp_path: Path) -> None:
    network: dict[str, Any] = {"port": 0, "host": "127.0.0.1", "identity": str(tmp_path / "k")}
    network |= {"retain_updates": 3, "heartbeat_period": 2.0, "client_mode": True}
    run: dict[str, Any] = {"model": "tiny", "fragments": 2, "run_id": "sections"}
    whole = JoinConfig(swarm=False, **run, **network)
    spec = build_run_spec(whole, CORPUS)
    alone = build_swarm_config(RunSettings(**run), NetworkSettings(**network), spec, 100, 0)
    assert alone == build_swarm_config(whole, whole, spec, 100, 0)
    assert alone.retain_updates == 6  # x P: as many rounds


def test_each_section_builds_its_own_component_config() -> None:
    assert OuterSettings().outer_config("sparse").momentum == 0.5  # the residual is a momentum
    assert OuterSettings(outer_momentum=0.0).outer_config("sparse").momentum == 0.0
    assert OuterSettings(correction="heloco").correction_config().kind == "heloco"
    assert MergeSettings(staleness="hinge", staleness_b=2).staleness_config().b == 2
    assert MergeSettings().token_weight_config(1234).reference_tokens == 1234
