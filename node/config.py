"""A node's configuration: every section of node/settings.py in one object, checked whole.

`JoinConfig` inherits the fields of every section, so `config.inner_steps` reads as before and
a part that needs one section takes that section's type (a JoinConfig is each of them; the
run-level sections together are `RunSettings`).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
from pathlib import Path
from typing import Any, ClassVar

from pydantic.dataclasses import dataclass

from dht.addresses import host_ip, listen_maddrs, parse_announce_maddr, parse_peer_maddr
from merge.allowlist import AllowList
from merge.codec_names import AUTO
from merge.identity import read_secret_file
from node.presets import MODEL_SIZES as MODEL_SIZES  # re-exported: callers name them here
from node.presets import auto_model
from node.presets import model_size as model_size
from node.settings import DEFAULT_IDENTITY as DEFAULT_IDENTITY  # re-exported: callers name
from node.settings import DEFAULT_PORT as DEFAULT_PORT  # them here
from node.settings import DILOCO_HOME as DILOCO_HOME
from node.settings import (
    FLAGS,
    SECTIONS,
    CheckpointSettings,
    DashboardSettings,
    LoggingSettings,
    NetworkSettings,
    RunSettings,
)
from node.settings_cli import add_config_arguments, config_from_args


@dataclass(kw_only=True, config=FLAGS)
class JoinConfig(
    LoggingSettings,
    CheckpointSettings,
    DashboardSettings,
    NetworkSettings,
    RunSettings,
):
    """Everything `diloco-node join` needs. Run-level fields enter the run fingerprint.

    The bases are listed last section first: a dataclass takes its bases' fields in reverse
    order, so the fields come in the sections' order (train first)."""

    SECTIONS: ClassVar[dict[str, tuple[type, str]]] = SECTIONS
    """`join --help` shows each section's flags under its title (node/settings_cli.py)."""

    def __post_init__(self) -> None:
        if self.model == "auto":
            self.model = auto_model(self.device)
        self._check_training()
        self.host = host_ip(self.host)  # raises for a bad --host; localhost is 127.0.0.1
        listen_maddrs(self.host, self.listen_port)  # raises for a bad --port
        self.peers = [str(parse_peer_maddr(p)) for p in self.peers or []] or None
        self.announce = [str(parse_announce_maddr(a)) for a in self.announce or []] or None
        _ = self.relay_limits  # raises for a bad --relay-max-*
        if self.allow_keys is not None:
            AllowList.load(self.allow_keys)  # one clear error now, not after the swarm starts
        self._check_dashboard()

    def _check_training(self) -> None:
        if self.fragments > self.inner_steps:
            raise ValueError(
                f"--fragments must be at most --inner-steps ({self.inner_steps}): one fragment "
                f"is published per inner step at most, got {self.fragments}"
            )
        if self.fragments > 1 and self.nproc_per_node > 1:
            raise ValueError("--fragments above 1 needs --nproc-per-node 1")
        if self.correction == "lookahead" and self.fragments > 1:
            raise ValueError("--correction lookahead is not available with --fragments > 1")
        if self.codec == AUTO and (self.fragments > 1 or self.groups_on):
            # fragments keep the codec they start with, and a group's parts travel in the one
            # its members start with: auto is bf16 there, as it is until measured
            self.codec = "bf16"

    def _check_dashboard(self) -> None:
        try:
            if self.dashboard_host.strip().lower() == "localhost":
                self.dashboard_host = "127.0.0.1"
            ipaddress.ip_address(self.dashboard_host)
        except ValueError:
            host = self.dashboard_host
            raise ValueError(
                f"--dashboard-host must be an IP address such as 127.0.0.1, got '{host}'"
            ) from None
        if self.dashboard_token_file is not None:
            from_file = read_secret_file(self.dashboard_token_file, "--dashboard-token-file")
            # the file's token already in place: a copy (dataclasses.replace) checks again
            if self.dashboard_token not in (None, from_file):
                raise ValueError("give --dashboard-token or --dashboard-token-file, not both")
            self.dashboard_token = from_file
        token = self.dashboard_token
        if token is not None and not (token.isascii() and token.isprintable() and " " not in token):
            raise ValueError("--dashboard-token must be printable ASCII without spaces")

    def checkpoint_path(self, peer_id: str) -> Path:
        """--checkpoint-dir, else ~/.diloco/checkpoints/RUN_ID/PEER_ID (one per node)."""
        if self.checkpoint_dir:
            return Path(self.checkpoint_dir).expanduser()
        return (self.run_checkpoints / peer_id).expanduser()

    @property
    def run_checkpoints(self) -> Path:
        """Where this run's nodes keep their default checkpoint dirs (and did before 0.2:
        directly in it)."""
        return (DILOCO_HOME / "checkpoints" / self.run_id).expanduser()


def run_fingerprint(run_spec: dict[str, Any]) -> str:
    """Hash of everything that must agree for two nodes to train the same model."""
    canonical = json.dumps(run_spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


dataclass_from_args = config_from_args
"""The name callers used before the settings moved to pydantic (tests, bench/adversary.py)."""

__all__ = [
    "JoinConfig",
    "run_fingerprint",
    "add_config_arguments",
    "config_from_args",
    "dataclass_from_args",
]
