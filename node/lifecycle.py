"""What a node checks and arranges on this machine before it joins: free port, reachable
bootstrap peers, and the move of a checkpoint from the pre-peer-id default directory."""

from __future__ import annotations

import logging
from pathlib import Path

from dht.preflight import PreflightError, check_port_free
from node.checkpoint import (
    LEGACY_FILE,
    MANIFEST_FILE,
    CheckpointError,
    checkpoint_files,
    read_checkpoint,
)
from node.config import JoinConfig

logger = logging.getLogger(__name__)


def preflight(config: JoinConfig) -> int:
    """The port to listen on; PreflightError (one line) for the causes p2pd would otherwise
    fail on obscurely. With no --port, the default port, when another node holds it,
    becomes any free port; a --port that is taken is an error. (The bootstrap peers are
    dialled, with retries, by dht.known_peers.join_peers.)"""
    port = config.listen_port
    try:
        check_port_free(config.host, port)
    except PreflightError:
        if config.port is not None:
            raise
        logger.info("port %d is taken (another node here?); listening on any free port", port)
        port = 0
    return port


def has_checkpoint(directory: Path) -> bool:
    return (directory / MANIFEST_FILE).exists() or (directory / LEGACY_FILE).exists()


def adopt_legacy_checkpoint(config: JoinConfig, peer_id: str) -> Path | None:
    """Move this node's checkpoint from ~/.diloco/checkpoints/RUN_ID (the default before it
    included the peer id) into its own directory; returns where it came from, if moved.

    Only a checkpoint written by this very identity moves; another node's stays put.
    """
    if config.checkpoint_dir:
        return None
    old, new = config.run_checkpoints, config.checkpoint_path(peer_id)
    if not has_checkpoint(old) or has_checkpoint(new):
        return None
    try:
        state = read_checkpoint(old)
    except CheckpointError as exc:
        logger.info("left the unreadable checkpoint in %s alone (%s)", old, exc)
        return None
    if state is None or state.get("peer_id") != peer_id:
        owner = state.get("peer_id") if state else None
        logger.info("a checkpoint of peer %s is in %s; --checkpoint-dir uses it", owner, old)
        return None
    files = list(checkpoint_files(old)) or [old / LEGACY_FILE]
    new.mkdir(parents=True, exist_ok=True)
    for path in reversed(files):  # the manifest last: the old dir stays usable until then
        path.replace(new / path.name)
    return old
