"""A node's Ed25519 identity: the key that signs its updates and names it in the swarm.

The key file uses libp2p's protobuf PrivateKey format, so the same file can be handed to
hivemind's p2pd (``identity_path``) and the daemon reports the same peer id as
:attr:`Identity.peer_id`. hivemind's own ``PeerID.from_identity`` only understands RSA keys:
with an Ed25519 identity and ``initial_peers``, pass ``check_if_identity_free=False`` to
``P2P.create``/``DHT``.

Ed25519 peer ids embed the public key (identity multihash), so anyone can recover the key
from the peer id alone and check a signature without asking the author for anything.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

logger = logging.getLogger(__name__)

# protobuf PrivateKey{Type: Ed25519 (1), Data: 64 bytes = seed || public key}
_PRIVATE_KEY_PREFIX = b"\x08\x01\x12\x40"
# protobuf PublicKey{Type: Ed25519 (1), Data: 32 bytes}
_PUBLIC_KEY_PREFIX = b"\x08\x01\x12\x20"
# multihash code 0x00 (identity), digest length 0x24 = 36 = len(protobuf PublicKey)
_IDENTITY_MULTIHASH_PREFIX = b"\x00\x24"
_PEER_ID_PREFIX = _IDENTITY_MULTIHASH_PREFIX + _PUBLIC_KEY_PREFIX
_KEY_FILE_SIZE = len(_PRIVATE_KEY_PREFIX) + 64
_PEER_ID_SIZE = len(_PEER_ID_PREFIX) + 32
_MAX_PEER_ID_CHARS = 128


class IdentityError(ValueError):
    """An identity key file is missing, unreadable or not an Ed25519 libp2p key."""


class Identity:
    """An Ed25519 private key with its libp2p peer id."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        self._public_key_bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self._peer_id = peer_id_from_public_key(self._public_key_bytes)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, raw32: bytes) -> Identity:
        """Builds an identity from a raw 32-byte Ed25519 seed."""
        if len(raw32) != 32:
            raise IdentityError(f"an Ed25519 seed has 32 bytes, got {len(raw32)}.")
        return cls(Ed25519PrivateKey.from_private_bytes(raw32))

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def public_key_bytes(self) -> bytes:
        return self._public_key_bytes

    def sign(self, data: bytes) -> bytes:
        return self._private_key.sign(data)

    def save(self, path: str | Path) -> None:
        """Writes the key atomically in libp2p format, readable by its owner only (0600)."""
        _write_private_file(Path(path), _PRIVATE_KEY_PREFIX + self._seed() + self._public_key_bytes)

    @classmethod
    def load(cls, path: str | Path) -> Identity:
        path = Path(path)
        data = _read_key_file(path)
        if len(data) != _KEY_FILE_SIZE or not data.startswith(_PRIVATE_KEY_PREFIX):
            raise IdentityError(f"identity file {path} is not an Ed25519 libp2p key.")
        seed = data[len(_PRIVATE_KEY_PREFIX) : len(_PRIVATE_KEY_PREFIX) + 32]
        identity = cls.from_private_bytes(seed)
        if identity.public_key_bytes != data[-32:]:
            raise IdentityError(
                f"identity file {path} is corrupt: its public key does not match its seed."
            )
        check_private_file(path, "identity file")
        return identity

    @classmethod
    def load_or_create(cls, path: str | Path) -> tuple[Identity, bool]:
        """Loads the identity at ``path``, or generates and saves one; the bool says created."""
        path = Path(path)
        if path.exists():
            return cls.load(path), False
        identity = cls.generate()
        identity.save(path)
        logger.info("created identity %s in %s", identity.peer_id, path)
        return identity, True

    def __repr__(self) -> str:
        return f"Identity(peer_id={self._peer_id!r})"

    def _seed(self) -> bytes:
        return self._private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )


def peer_id_from_public_key(public_key: bytes) -> str:
    """The libp2p peer id (base58btc) of a raw 32-byte Ed25519 public key."""
    if len(public_key) != 32:
        raise ValueError(f"an Ed25519 public key has 32 bytes, got {len(public_key)}.")
    return base58.b58encode(_PEER_ID_PREFIX + public_key).decode("ascii")


def public_key_from_peer_id(peer_id: str) -> Ed25519PublicKey:
    """Recovers the Ed25519 public key embedded in a libp2p peer id."""
    if not isinstance(peer_id, str) or not 0 < len(peer_id) <= _MAX_PEER_ID_CHARS:
        raise ValueError("a peer id is a non-empty string of at most 128 characters.")
    try:
        raw = base58.b58decode(peer_id)
    except ValueError as e:
        raise ValueError(f"peer id {peer_id!r} is not valid base58.") from e
    if len(raw) != _PEER_ID_SIZE or not raw.startswith(_PEER_ID_PREFIX):
        raise ValueError(f"peer id {peer_id!r} does not embed an Ed25519 public key.")
    return Ed25519PublicKey.from_public_bytes(raw[len(_PEER_ID_PREFIX) :])


def verify_signature(peer_id: str, data: bytes, signature: bytes) -> bool:
    """True when ``signature`` is the author's Ed25519 signature of ``data``; never raises."""
    try:
        public_key_from_peer_id(peer_id).verify(signature, data)
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def check_private_file(path: Path, what: str) -> None:
    """IdentityError unless only the owner may read ``path`` (a secret the others could copy)."""
    try:
        mode = path.stat().st_mode & 0o777
    except OSError as e:
        raise IdentityError(f"{what} {path} could not be read: {e.strerror}.") from e
    if mode & 0o077:
        raise IdentityError(
            f"{what} {path} is readable by other users (mode {mode:04o}); run: chmod 600 {path}"
        )


def read_secret_file(path: str | Path, what: str) -> str:
    """The first line of a private text file (a token), refused if others may read it."""
    path = Path(path).expanduser()
    try:
        with path.open("rb") as f:
            data = f.read(4097)
    except OSError as e:
        raise IdentityError(f"{what} {path} could not be read: {e.strerror or e}.") from None
    check_private_file(path, what)
    if len(data) > 4096:
        raise IdentityError(f"{what} {path} is larger than 4 KiB: it does not hold a token.")
    lines = data.decode("utf-8", errors="replace").strip().splitlines()
    if not lines or not lines[0].strip():
        raise IdentityError(f"{what} {path} is empty.")
    return lines[0].strip()


def _read_key_file(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            return f.read(_KEY_FILE_SIZE + 1)
    except FileNotFoundError as e:
        raise IdentityError(f"identity file {path} does not exist.") from e
    except OSError as e:
        raise IdentityError(f"identity file {path} could not be read: {e.strerror}.") from e


def _write_private_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    # Makes the rename durable; not every filesystem lets a directory be opened.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
