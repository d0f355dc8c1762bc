"""The dashboard's settings: one object for the app, one dataclass for the standalone CLI."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import pydantic.dataclasses
from pydantic import ConfigDict

from dht.addresses import parse_peer_maddr
from merge.allowlist import AllowList
from merge.identity import read_secret_file


@dataclass(frozen=True, kw_only=True)
class DashboardSettings:
    """Everything the app and its data source need; built by the node or by the CLI."""

    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = None
    poll_period_s: float = 2.0
    """How often the data source reads the swarm and samples the history."""
    history_points: int = 900
    """Swarm samples kept: 30 minutes at the default poll period."""
    peer_points: int = 300
    """Loss points kept per peer (one per round)."""
    timeline_events: int = 500
    """Joins, leaves and failures kept for the timeline."""

    def __post_init__(self) -> None:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            raise ValueError(
                f"--host must be an IP address such as 127.0.0.1, got '{self.host}'"
            ) from None
        if isinstance(self.port, bool) or not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be between 0 and 65535, got {self.port}")
        if self.token is not None and not is_valid_token(self.token):
            raise ValueError("--token must be printable ASCII without spaces")
        if not 0.05 <= self.poll_period_s <= 600:
            raise ValueError(f"the poll period must be 0.05 to 600 s, got {self.poll_period_s}")
        if min(self.history_points, self.peer_points, self.timeline_events) < 2:
            raise ValueError("history sizes must be at least 2")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"--{name} must be one of {', '.join(choices)}; got '{value}'")


def is_valid_token(token: str) -> bool:
    """A token fits in an HTTP header as it is: non-empty printable ASCII, no spaces."""
    return bool(token) and token.isascii() and token.isprintable() and " " not in token


@pydantic.dataclasses.dataclass(
    kw_only=True, config=ConfigDict(use_attribute_docstrings=True, allow_inf_nan=False)
)
class StandaloneConfig:
    """`diloco-node dashboard`: watch a swarm through any of its members, train nothing."""

    peers: list[str] | None = None
    """Multiaddrs of any swarm members (required), e.g. the address a node printed at start."""
    run_id: str | None = None
    """Run to show (default: the one run found through the peers; the default run if none yet)."""
    host: str = "127.0.0.1"
    """Address to listen on; 0.0.0.0 opens the dashboard to the network (set a token)."""
    port: int = 8000
    """TCP port to serve the dashboard on (0: any free port, printed at start)."""
    token: str | None = None
    """Require 'Authorization: Bearer TOKEN' on every route (browser: open /?token=TOKEN once)."""
    token_file: str | None = None
    """Read the token from this file (mode 0600): unlike --token, it does not show in ps."""
    allow_keys: str | None = None
    """Permissioned run: show only the peers this TOML/YAML allow list names, under its orgs."""
    log_level: str = "INFO"
    """Logging level: DEBUG, INFO, WARNING or ERROR."""
    log_format: str = "rich"
    """rich: a line for people; json: the bound URL as a JSON event on stdout."""

    def __post_init__(self) -> None:
        if not self.peers:
            raise ValueError(
                "--peers is required: the multiaddr of any swarm member, as a node prints it"
            )
        self.peers = [str(parse_peer_maddr(p)) for p in self.peers]
        if self.run_id is not None and not 0 < len(self.run_id) <= 64:
            raise ValueError("--run-id must be 1 to 64 characters long")
        _check_choice("log-level", self.log_level.upper(), ("DEBUG", "INFO", "WARNING", "ERROR"))
        _check_choice("log-format", self.log_format, ("rich", "json"))
        if self.token_file is not None:
            if self.token is not None:
                raise ValueError("give --token or --token-file, not both")
            self.token = read_secret_file(self.token_file, "--token-file")
        if self.allow_keys is not None:
            AllowList.load(self.allow_keys)  # one clear error before the DHT starts
        self.settings()  # raises for a bad --host, --port or --token

    def settings(self) -> DashboardSettings:
        return DashboardSettings(host=self.host, port=self.port, token=self.token)
