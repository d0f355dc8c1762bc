"""The peers a node knew last run, kept in a small file beside its checkpoint.

On restart the node tries them besides its --peers, so a dead bootstrap never keeps a known
member out. The file is written atomically (a temporary file renamed over it) and read as
untrusted input: bounded in size, parsed strictly; anything wrong with it costs one log line
and an empty list, never the node.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dht.addresses import AddressError, parse_peer_maddr
from dht.bootstrap_retry import RetryBounds, candidates
from dht.heartbeat import Heartbeat
from dht.preflight import PreflightError, reach_peers

logger = logging.getLogger(__name__)

KNOWN_PEERS_FILE = "known_peers.json"
MAX_KNOWN_PEERS = 32
MAX_FILE_BYTES = 32 << 10
FORMAT_VERSION = 1

Maddr = Annotated[str, Field(min_length=1, max_length=256)]


class KnownPeers(BaseModel):
    """The file's content: peer addresses ending in /p2p/<peer id>, most recently seen first."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    version: int
    peers: Annotated[list[Maddr], Field(max_length=MAX_KNOWN_PEERS)]

    @field_validator("version")
    @classmethod
    def _known_version(cls, version: int) -> int:
        if version != FORMAT_VERSION:
            raise ValueError(f"version {version} is not {FORMAT_VERSION}")
        return version

    @field_validator("peers")
    @classmethod
    def _dialable(cls, peers: list[str]) -> list[str]:
        for text in peers:
            parse_peer_maddr(text)  # AddressError is a ValueError: pydantic reports it
        return peers


def known_peers_path(checkpoint_dir: Path) -> Path:
    return checkpoint_dir / KNOWN_PEERS_FILE


def load_known_peers(path: Path) -> list[str]:
    """The addresses in `path`; [] (and one line saying why) if it is missing or not valid."""
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return []
    except OSError as exc:
        logger.warning("ignoring known peers file %s: %s", path, exc.strerror or exc)
        return []
    if len(raw) > MAX_FILE_BYTES:
        logger.warning("ignoring known peers file %s: larger than %d bytes", path, MAX_FILE_BYTES)
        return []
    try:
        return list(KnownPeers.model_validate_json(raw).peers)
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"] if exc.errors() else "not valid"
        logger.warning("ignoring known peers file %s: %s", path, reason)
        return []


def save_known_peers(path: Path, maddrs: Iterable[str]) -> list[str]:
    """Write the first MAX_KNOWN_PEERS distinct dialable addresses atomically; returns them."""
    peers = [m for m in dict.fromkeys(maddrs) if _is_dialable(m)][:MAX_KNOWN_PEERS]
    blob = json.dumps({"version": FORMAT_VERSION, "peers": peers}, indent=1).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".known_peers.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(blob)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return peers


@dataclass(frozen=True)
class PeersToDial:
    now: list[str]
    """Dialled at start (hivemind's bootstrap)."""
    rejoin: list[str]
    """A known member's peers, dialled in the background while none answers
    (dht.bootstrap_rejoin); empty for a newcomer, which has nothing to train on alone."""


def join_peers(bootstrap: list[str], checkpoint_dir: Path, *, known_member: bool) -> PeersToDial:
    """The peers to dial at start: the bootstrap and the peers known last run that answer.

    A newcomer retries with bounded backoff and exits once that is spent
    (dht/preflight.reach_peers). A known member (it has a checkpoint) tries once: if nobody
    answers it trains on its checkpoint and keeps dialling them in the background."""
    known = load_known_peers(known_peers_path(checkpoint_dir))
    if not known_member or not bootstrap:
        return PeersToDial(reach_peers(bootstrap, known), [])
    tried = candidates(bootstrap, known)
    try:
        now = reach_peers(bootstrap, known, bounds=RetryBounds(give_up_after_s=0))
    except PreflightError as exc:
        logger.info("%s", exc)
        now = []
    return PeersToDial(now, tried)


def remember_peers(checkpoint_dir: Path, alive: Iterable[Heartbeat]) -> list[str]:
    """Keep the live peers' addresses for the next run, the most recently heard first, then
    those known before (so a node that saw no one at its end forgets no one)."""
    newest = sorted(alive, key=lambda beat: beat.sent_at, reverse=True)
    maddrs = [m for beat in newest for m in peer_addresses(beat.peer_id, beat.maddrs)]
    path = known_peers_path(checkpoint_dir)
    try:
        return save_known_peers(path, maddrs + load_known_peers(path))
    except OSError as exc:  # the checkpoint matters more: say so and go on
        logger.warning("could not write known peers to %s: %s", path, exc.strerror or exc)
        return []


def peer_addresses(peer_id: str, maddrs: Iterable[str]) -> list[str]:
    """A peer's advertised addresses, each ending with /p2p/`peer_id`."""
    suffix = f"/p2p/{peer_id}"
    return [
        m if m.endswith(suffix) else m + suffix
        for m in maddrs
        if "/p2p/" not in m or m.endswith(suffix)
    ]


def _is_dialable(text: str) -> bool:
    if len(text) > 256:
        return False
    try:
        parse_peer_maddr(text)
    except (AddressError, ValueError):
        return False
    return True
