"""The codec names the settings check --codec against (merge/codec_names.py, loaded without
torch) are the codecs' own."""

from __future__ import annotations

from merge.codec_names import AUTO, CODEC_NAMES
from merge.codecs import CODECS


def test_the_names_the_cli_accepts_are_the_codecs_in_their_order() -> None:
    assert tuple(CODECS) == CODEC_NAMES
    assert AUTO not in CODECS
