"""Error feedback: what a lossy codec drops this round is sent in a later one (SparseLoCo).

The compressor keeps a residual: each round it encodes pseudo_gradient + residual and keeps
as the new residual what the payload does not carry. Over any number of rounds the decoded
payloads plus the residual add up to the pseudo-gradients put in, so compression delays
progress but loses none. A codec without error feedback passes its input straight through.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from merge.codec_base import Codec, CodecError

DEFAULT_OUTER_MOMENTUM = 0.9
"""The outer Nesterov momentum of DiLoCo, for codecs whose residual stays small."""
OUTER_MOMENTUM_BY_CODEC = {"sparse": 0.5}
"""Codecs whose error feedback residual carries several rounds of progress: it already acts
as a momentum (SparseLoCo replaces the outer momentum with it), and the outer momentum on top
overshoots. bench.wire (tiny, 2 learners, 12 rounds of 10 steps, at equal tokens): sparse
ended 1.026x bf16's validation loss with 0.9, 0.994x with 0.5 (1.015x with 0, outer lr 0.7);
its residual's norm was 4-5x a round's pseudo-gradient, int8's and int4's a few percent."""


RESTART_FROM_REPLICA = frozenset({"sparse"})
"""Codecs whose learners start each round from the replica itself, not from the replica minus
their residual (Compressor.round_start). bench.wire (tiny, M = 4, H = 25, 12 rounds, equal
tokens): sparse (2.9 % density, outer momentum 0.5) ended 1.263x bf16's validation loss when
started from replica - residual, 1.167x from the replica: so little is sent a round that the
residual holds most of the progress, and relearning it is what moves the replica soon enough.
topk (9.4 %) gains from the new start (docs/codecs.md)."""


def default_outer_momentum(codec: str) -> float:
    """The outer momentum a run with ``codec`` uses unless --outer-momentum says otherwise."""
    return OUTER_MOMENTUM_BY_CODEC.get(codec, DEFAULT_OUTER_MOMENTUM)


class Compressor:
    """Encodes a node's successive pseudo-gradients with ``codec``, carrying the residual.

    The codec may change between payloads (`switch`, `--codec auto`): the residual is what
    the earlier payloads left out whichever codec sent them, so the next payload carries it;
    a codec without error feedback sends it whole and drops it. `flush` sends it alone."""

    def __init__(self, codec: Codec, numel: int) -> None:
        self.codec = codec
        self.numel = numel
        self.residual = torch.zeros(numel if codec.error_feedback else 0, dtype=torch.float32)

    def round_start(self, base: torch.Tensor) -> torch.Tensor:
        """Where this learner's next round starts: ``base`` (the replica) minus the residual,
        i.e. with the progress it trained but has not sent yet still applied. The round's
        pseudo-gradient is then taken from this start, so pseudo-gradient + residual, what
        the next payload encodes, is exactly ``base`` - the learner's params: its whole way
        from the replica, sent once. Started from ``base`` itself, a learner relearns part of
        its residual in the round's steps and sends it twice (bench.wire at M = 4, H = 25:
        docs/codecs.md). ``base`` itself without a residual and for the codecs in
        RESTART_FROM_REPLICA."""
        if self.residual.numel() == 0 or self.codec.name in RESTART_FROM_REPLICA:
            return base
        return base - self.residual

    def switch(self, codec: Codec) -> None:
        """Send the next payloads with ``codec``; the residual carries over into them."""
        if codec.error_feedback and self.residual.numel() == 0:
            self.residual = torch.zeros(self.numel, dtype=torch.float32)
        self.codec = codec

    def encode(self, pseudo_gradient: torch.Tensor) -> bytes:
        """The payload for this round; updates the residual to what it leaves out."""
        if not self.codec.error_feedback:
            if self.residual.numel() == 0:
                return self.codec.encode(pseudo_gradient)
            payload = self.codec.encode(pseudo_gradient + self.residual)
            self.residual = torch.zeros(0, dtype=torch.float32)  # sent whole: nothing carried
            return payload
        target = pseudo_gradient + self.residual
        payload = self.codec.encode(target)
        try:
            target -= self.codec.decode(payload, self.numel)
        except CodecError:  # non-finite input: the pipeline rejects this payload
            target.fill_(float("nan"))
        if bool(torch.isfinite(target).all()):
            self.residual = target
        else:  # a diverged round must not poison every later one
            self.residual.zero_()
        return payload

    def pending(self) -> bool:
        """Whether the residual holds progress not sent yet."""
        return bool(self.residual.numel()) and bool(self.residual.any())

    def flush(self, codec: Codec) -> tuple[torch.Tensor, bytes]:
        """The residual alone as a payload of ``codec`` (dense: a stopping node sends what it
        trained but has not sent, instead of keeping it); the residual is then empty (what
        ``codec`` itself rounds off is dropped, as with any payload of a codec without error
        feedback). Returns (the residual sent, the payload)."""
        residual = self.residual.clone() if self.residual.numel() else torch.zeros(self.numel)
        payload = codec.encode(residual)
        self.residual.zero_()
        return residual, payload

    def state_dict(self) -> dict[str, object]:
        """Loadable with torch.load(weights_only=True)."""
        return {"codec": self.codec.name, "residual": self.residual.clone()}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restores the residual, whichever codec left it (what was not sent is progress in
        any codec: the next payload carries it); none saved (a codec without error feedback,
        or an older checkpoint) restores none."""
        residual = state.get("residual")
        if residual is None or (isinstance(residual, torch.Tensor) and residual.numel() == 0):
            self.residual = torch.zeros(
                self.numel if self.codec.error_feedback else 0, dtype=torch.float32
            )
            return
        if not isinstance(residual, torch.Tensor) or residual.shape != (self.numel,):
            raise ValueError(f"error feedback residual must have {self.numel} elements.")
        if residual.dtype != torch.float32 or not bool(torch.isfinite(residual).all()):
            raise ValueError("error feedback residual must be finite fp32.")
        self.residual = residual.clone()
