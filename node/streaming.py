"""Streaming fragments (Streaming DiLoCo, arXiv 2501.18512) on a node: what is due when.

With P fragments (merge.fragments) a node publishes fragment p after inner step
``publish_steps(P, H)[p]`` of every round, as its own signed update. Each fragment runs its
own staggered round: its pseudo-gradient is its params when it was last published (the
merged replica's, which the learner then adopted) minus the learner's params now, and covers
the inner steps since then. A node that dies mid-round has already published the fragments
due before, so it loses only what its unpublished fragments gathered since their last
publication.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from merge.codec_base import Codec
from merge.feedback import Compressor
from merge.fragments import FragmentLayout, publish_steps


@dataclass
class FragmentRound:
    """One fragment's inner steps since it was last published (or since the stream began)."""

    base_applied: int
    """Updates the replica held when the fragment's base was taken."""
    steps: int = 0
    tokens: int = 0
    loss_sum: float = 0.0

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.steps, 1)


class FragmentStream:
    """The bases and rounds of P fragments, and which fragment is due after which step."""

    def __init__(
        self, layout: FragmentLayout, inner_steps: int, base: torch.Tensor, base_applied: int
    ) -> None:
        self.layout = layout
        self.publish_steps = publish_steps(layout.num_fragments, inner_steps)
        self.base = base.clone()
        """The flat params; fragment p's elements are its base (its last adopted params)."""
        self.rounds = [FragmentRound(base_applied) for _ in range(layout.num_fragments)]

    def record_step(self, tokens: int, loss: float) -> None:
        """One inner step done: every fragment's round gains it."""
        for r in self.rounds:
            r.steps += 1
            r.tokens += tokens
            r.loss_sum += loss

    def due(self, step: int) -> list[int]:
        """Fragments to publish after inner step ``step`` (from 1) of the round."""
        return [p for p, at in enumerate(self.publish_steps) if at == step]

    def unpublished(self, steps_done: int) -> list[int]:
        """Fragments still due in a round that ended after ``steps_done`` steps (--round-time)."""
        return [p for p, at in enumerate(self.publish_steps) if at > steps_done]

    def pseudo_gradient(self, fragment: int, inner: torch.Tensor) -> torch.Tensor:
        """The fragment's base minus the learner's params ``inner`` (flat), as a fragment vector."""
        return self.layout.gather(self.base, fragment) - self.layout.gather(inner, fragment)

    def adopt(self, fragment: int, merged: torch.Tensor, applied: int) -> None:
        """The fragment was published and ``merged`` (a fragment vector) is the replica's now:
        its next round starts from there."""
        self.layout.scatter(self.base, fragment, merged)
        self.rounds[fragment] = FragmentRound(applied)


class FragmentCompressors:
    """Error feedback per fragment: one compressor each, saved as one flat residual."""

    def __init__(self, codec: Codec, layout: FragmentLayout) -> None:
        self.codec = codec
        self.layout = layout
        self._parts = [
            Compressor(codec, layout.fragment_numel(p)) for p in range(layout.num_fragments)
        ]

    def encode(self, fragment: int, pseudo_gradient: torch.Tensor) -> bytes:
        return self._parts[fragment].encode(pseudo_gradient)

    def part(self, fragment: int) -> Compressor:
        """Fragment ``fragment``'s compressor (its residual: node.publishing flushes it)."""
        return self._parts[fragment]

    def round_start(self, base: torch.Tensor) -> torch.Tensor:
        """The whole model's start: ``base`` minus every fragment's residual (what was
        trained but not sent yet; merge.feedback.Compressor.round_start)."""
        if not self.codec.error_feedback:
            return base
        start = base.clone()
        for p, part in enumerate(self._parts):
            self.layout.scatter(start, p, part.round_start(self.layout.gather(base, p)))
        return start

    def fragment_start(self, fragment: int, merged: torch.Tensor) -> torch.Tensor:
        """Fragment ``fragment``'s next start from its merged params ``merged``."""
        return self._parts[fragment].round_start(merged)

    def state_dict(self) -> dict[str, object]:
        """The format of Compressor.state_dict for the whole model (loadable weights_only)."""
        residual = torch.zeros(self.layout.numel if self.codec.error_feedback else 0)
        if self.codec.error_feedback:
            for p, part in enumerate(self._parts):
                self.layout.scatter(residual, p, part.residual)
        return {"codec": self.codec.name, "residual": residual}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        residual = state.get("residual")
        if state.get("codec") != self.codec.name or not self.codec.error_feedback:
            for part in self._parts:
                part.load_state_dict({})  # another codec's residual does not apply
            return
        if not isinstance(residual, torch.Tensor) or residual.shape != (self.layout.numel,):
            raise ValueError(f"error feedback residual must have {self.layout.numel} elements.")
        for p, part in enumerate(self._parts):
            part.load_state_dict(
                {"codec": self.codec.name, "residual": self.layout.gather(residual, p)}
            )
