"""Permissioned swarms: `--allow-keys FILE` lists, per organization, who may contribute.

The file maps organization names to peer ids (12D3KooW...) or raw Ed25519 public keys (64
hex characters), in TOML (read with the standard library's tomllib) or YAML (PyYAML):

    # allow.toml
    "lab-a" = ["12D3KooW...", "12D3KooW..."]
    "lab-b" = ["3b6a27bc...64 hex characters"]

Updates, heartbeats and state from keys outside the list are ignored and counted; the
organization a peer is shown under comes from this file, not from the peer's own claim.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from merge.identity import peer_id_from_public_key, public_key_from_peer_id

MAX_FILE_BYTES = 4 << 20
MAX_ORG_CHARS = 64
_HEX_KEY = re.compile(r"[0-9a-fA-F]{64}")


class AllowListError(ValueError):
    """The allow-list file cannot be used; the message names the file and the problem."""


class AllowList:
    """Peer id -> organization, for the keys allowed to take part in a permissioned run."""

    def __init__(self, orgs_by_peer: dict[str, str]) -> None:
        self._orgs = dict(orgs_by_peer)

    @classmethod
    def load(cls, path: str | Path) -> AllowList:
        path = Path(path).expanduser()
        return cls.from_mapping(_read(path), str(path))

    @classmethod
    def from_mapping(cls, data: object, source: str = "allow list") -> AllowList:
        if not isinstance(data, dict) or not data:
            raise AllowListError(f"{source}: expected organization names mapped to key lists.")
        orgs: dict[str, str] = {}
        for org, keys in data.items():
            if not isinstance(org, str) or not 0 < len(org) <= MAX_ORG_CHARS:
                raise AllowListError(f"{source}: organization names are 1 to 64 characters.")
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                raise AllowListError(f"{source}: organization '{org}' needs a list of keys.")
            for key in keys:
                peer_id = _peer_id(key.strip(), f"{source}: organization '{org}'")
                if orgs.setdefault(peer_id, org) != org:
                    raise AllowListError(f"{source}: {peer_id} is listed under two organizations.")
        return cls(orgs)

    def allows(self, peer_id: str) -> bool:
        return peer_id in self._orgs

    def org_of(self, peer_id: str) -> str | None:
        return self._orgs.get(peer_id)

    @property
    def orgs(self) -> dict[str, str]:
        """A copy: peer id -> organization."""
        return dict(self._orgs)

    def __len__(self) -> int:
        return len(self._orgs)


def _read(path: Path) -> object:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise AllowListError(f"allow-list file {path} could not be read: {e.strerror}.") from None
    if len(raw) > MAX_FILE_BYTES:
        raise AllowListError(f"allow-list file {path} is larger than 4 MiB.")
    if path.suffix.lower() in (".yaml", ".yml"):
        return _parse_yaml(raw, path)
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise AllowListError(f"allow-list file {path} is not valid TOML: {e}.") from None


def _parse_yaml(raw: bytes, path: Path) -> object:
    try:
        import yaml
    except ImportError:
        raise AllowListError(
            f"allow-list file {path} is YAML: pip install pyyaml, or write it in TOML."
        ) from None
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise AllowListError(f"allow-list file {path} is not valid YAML: {reason}.") from None


def _peer_id(key: str, where: str) -> str:
    if _HEX_KEY.fullmatch(key):
        return peer_id_from_public_key(bytes.fromhex(key))
    try:
        public_key_from_peer_id(key)
    except ValueError:
        raise AllowListError(
            f"{where}: '{key[:80]}' is neither a peer id nor a 64-hex Ed25519 public key."
        ) from None
    return key
