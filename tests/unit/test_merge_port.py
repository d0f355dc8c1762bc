"""dht/ calls the merge through dht.merge_port.MergePort; merge.pipeline.UpdatePipeline must
offer every member of it with the same parameters (mypy checks the types where node/ passes
the pipeline to the swarm; this catches a renamed or reshaped method without mypy)."""

from __future__ import annotations

import inspect

import torch

from dht.merge_port import MergePort
from merge.outer import make_outer_optimizer
from merge.pipeline import MergeConfig, UpdatePipeline
from merge.replica import Replica
from merge.weighting import TokenWeightConfig


def port_members() -> list[str]:
    return [name for name in vars(MergePort) if not name.startswith("_")]


def test_the_pipeline_is_a_merge_port() -> None:
    config = MergeConfig(
        token_weight=TokenWeightConfig(reference_tokens=1000),
        max_inner_steps=100,
        max_tokens_per_step=100,
    )
    replica = Replica(torch.zeros(4), make_outer_optimizer(config.outer, 4))
    pipeline = UpdatePipeline(replica, config, "ab" * 32)
    assert isinstance(pipeline, MergePort)
    assert isinstance(pipeline.replica, Replica)


def test_the_port_names_the_pipeline_methods_dht_calls() -> None:
    assert set(port_members()) == {
        "replica",
        "rejection_log",
        "check_header",
        "evidence",
        "submit",
        "submit_group",
        "learn_proof",
        "group_evidence",
        "learn_group_proof",
        "transfer_state",
        "adopt",
        "is_fresh_author",
    }
    for name in port_members():
        declared = getattr(MergePort, name)
        if isinstance(declared, property):
            continue
        offered = inspect.signature(getattr(UpdatePipeline, name))
        assert list(offered.parameters) == list(inspect.signature(declared).parameters), name
