"""An update's payload as the merge reads it: its hash checked against the signed header, the
codec's tensor and its finite norm; what fails is a rejection (`Rejected`) the pipeline counts."""

from __future__ import annotations

import math

import torch

from merge.codec_base import DecodesInto
from merge.codecs import CodecError, get_codec
from merge.envelope import SignedUpdate, payload_matches


class Rejected(Exception):
    """An update refused; ``reason`` names the rejection the pipeline counts."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def decode_payload(
    update: SignedUpdate, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, float]:
    """The pseudo-gradient (possibly aliasing the payload or ``out``: read-only) and its finite
    norm. The payload is hashed on torch's threads: the rest of the path runs on them too."""
    header = update.header
    if not payload_matches(header, update.payload, max_threads=torch.get_num_threads()):
        raise Rejected("payload_hash_mismatch")
    codec = get_codec(header.codec)
    try:
        if out is not None and isinstance(codec, DecodesInto):
            pseudo_gradient = codec.decode_into(update.payload, header.numel, out)
        else:
            pseudo_gradient = codec.decode_view(update.payload, header.numel)
    except CodecError:
        raise Rejected("malformed") from None
    # One pass: a NaN or infinity anywhere makes the norm non-finite.
    update_norm = float(torch.linalg.vector_norm(pseudo_gradient))
    if not math.isfinite(update_norm):
        finite = bool(torch.isfinite(pseudo_gradient).all())
        raise Rejected("norm_too_large" if finite else "non_finite")
    return pseudo_gradient, update_norm


def raise_if(reason: str | None) -> None:
    """Raises `Rejected` for a reason; None passes."""
    if reason is not None:
        raise Rejected(reason)
