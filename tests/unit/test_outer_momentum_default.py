"""The outer momentum follows the codec unless --outer-momentum is given (merge.feedback)."""

from __future__ import annotations

import pytest
import torch

from bench.wire import make_pipeline
from merge.codecs import CODECS
from merge.feedback import default_outer_momentum
from node.builders import build_merge_config
from node.config import JoinConfig


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_a_node_uses_its_codecs_default_outer_momentum(codec: str) -> None:
    merge = build_merge_config(JoinConfig(codec=codec, swarm=False), 100)
    assert merge.outer.momentum == default_outer_momentum(codec)
    # sparse's residual holds rounds of progress and acts as a momentum of its own
    assert merge.outer.momentum == (0.5 if codec == "sparse" else 0.9)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_an_explicit_outer_momentum_wins_over_the_codecs(momentum: float) -> None:
    config = JoinConfig(codec="sparse", outer_momentum=momentum, swarm=False)
    assert build_merge_config(config, 100).outer.momentum == momentum


def test_an_outer_momentum_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="outer-momentum"):
        JoinConfig(codec="sparse", outer_momentum=1.0, swarm=False)


@pytest.mark.parametrize("codec", ["bf16", "sparse"])
def test_bench_wire_trains_each_codec_with_the_nodes_outer_optimizer(codec: str) -> None:
    pipeline = make_pipeline(torch.zeros(8), 10, 100, codec)
    node = build_merge_config(JoinConfig(codec=codec, swarm=False), 100)
    assert pipeline.replica.outer_for(None).momentum == node.outer.momentum
    assert pipeline.replica.outer_for(None).lr == node.outer.lr
