"""The codecs' names without the codecs: what the settings check --codec against, importable
without torch, so `diloco-node --help`, `--version` and a mistyped flag answer before torch
would have loaded (seconds; tens of seconds on a loaded machine)."""

from __future__ import annotations

CODEC_NAMES = ("fp32", "bf16", "int8", "int4", "sparse", "topk")
"""merge.codecs.CODECS's names, in its order (tests/unit/test_codec_names.py holds them equal)."""
AUTO = "auto"
"""`--codec auto`: the node picks its codec with merge.codec_policy's `CodecPicker`."""
