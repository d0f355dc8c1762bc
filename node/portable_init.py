"""Parameter initialisation that draws the same samples on every machine."""

from __future__ import annotations

import torch
from torch import Tensor


def normal_portable_(p: Tensor, std: float, generator: torch.Generator | None) -> None:
    """Fill `p` from N(0, std) with the same samples on every machine."""
    # torch's float32 normal_ takes a different (SIMD) code path per CPU capability, so its
    # samples differ between machines; the float64 path is scalar and portable.
    sample = torch.empty(p.shape, dtype=torch.float64, device="cpu")
    sample.normal_(0.0, std, generator=generator)
    p.copy_(sample)
