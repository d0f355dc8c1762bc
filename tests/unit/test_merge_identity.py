import asyncio
import stat
from pathlib import Path

import pytest

from merge.identity import (
    Identity,
    IdentityError,
    public_key_from_peer_id,
    read_secret_file,
    verify_signature,
)


def test_save_load_round_trip_keeps_peer_id_and_signing_key(tmp_path: Path) -> None:
    identity = Identity.generate()
    path = tmp_path / "keys" / "node" / "identity.key"
    identity.save(path)

    loaded = Identity.load(path)

    assert loaded.peer_id == identity.peer_id
    assert loaded.public_key_bytes == identity.public_key_bytes
    assert verify_signature(identity.peer_id, b"hello", loaded.sign(b"hello"))
    raw = path.read_bytes()
    assert len(raw) == 68 and raw[:4] == b"\x08\x01\x12\x40"
    assert raw[36:] == identity.public_key_bytes


def test_saved_key_is_private_to_its_owner(tmp_path: Path) -> None:
    path = tmp_path / "new_dir" / "identity.key"
    Identity.generate().save(path)

    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["identity.key"]  # no temp file left


def test_save_replaces_an_existing_key(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    Identity.generate().save(path)
    second = Identity.generate()
    second.save(path)

    assert Identity.load(path).peer_id == second.peer_id


def test_load_or_create_creates_once_then_loads(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"

    first, created = Identity.load_or_create(path)
    again, created_again = Identity.load_or_create(path)

    assert (created, created_again) == (True, False)
    assert again.peer_id == first.peer_id


def test_from_private_bytes_is_deterministic() -> None:
    seed = bytes(range(32))
    assert Identity.from_private_bytes(seed).peer_id == Identity.from_private_bytes(seed).peer_id
    with pytest.raises(IdentityError):
        Identity.from_private_bytes(b"short")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is not an Ed25519 libp2p key"),
        (b"\x08\x01\x12\x40" + bytes(63), "is not an Ed25519 libp2p key"),
        (b"\x08\x00\x12\x40" + bytes(64), "is not an Ed25519 libp2p key"),
        (b"\x08\x01\x12\x40" + bytes(65), "is not an Ed25519 libp2p key"),
        (b"\x08\x01\x12\x40" + bytes(32) + b"\x01" * 32, "does not match"),
    ],
)
def test_corrupt_key_file_is_refused_with_its_path(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "identity.key"
    path.write_bytes(content)

    with pytest.raises(IdentityError, match=message) as excinfo:
        Identity.load(path)
    assert str(path) in str(excinfo.value)


def test_missing_or_unreadable_key_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="does not exist"):
        Identity.load(tmp_path / "absent.key")
    with pytest.raises(IdentityError, match="could not be read"):
        Identity.load(tmp_path)


def test_public_key_is_recovered_from_the_peer_id() -> None:
    identity = Identity.generate()
    signature = identity.sign(b"payload")

    key = public_key_from_peer_id(identity.peer_id)
    key.verify(signature, b"payload")  # raises if wrong

    assert identity.peer_id.startswith("12D3KooW")
    assert verify_signature(identity.peer_id, b"payload", signature)
    assert not verify_signature(identity.peer_id, b"payload!", signature)
    assert not verify_signature(Identity.generate().peer_id, b"payload", signature)


@pytest.mark.parametrize(
    "peer_id",
    [
        "",
        "not base58 0OIl",
        "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",  # sha256 multihash (RSA key)
        "12D3KooW",
        "1" * 200,
    ],
)
def test_malformed_peer_ids_never_verify(peer_id: str) -> None:
    with pytest.raises(ValueError):
        public_key_from_peer_id(peer_id)
    assert not verify_signature(peer_id, b"data", bytes(64))


def test_verify_signature_never_raises_on_junk() -> None:
    identity = Identity.generate()
    assert not verify_signature(identity.peer_id, b"data", b"short")
    assert not verify_signature(identity.peer_id, b"data", "text")  # type: ignore[arg-type]
    assert not verify_signature(None, b"data", bytes(64))  # type: ignore[arg-type]
    assert not verify_signature(identity.peer_id, None, bytes(64))  # type: ignore[arg-type]


def test_key_file_and_peer_id_match_hivemind_encoding(tmp_path: Path) -> None:
    multihash = pytest.importorskip("multihash")
    hivemind_p2p = pytest.importorskip("hivemind.p2p")
    from hivemind.proto import crypto_pb2

    identity = Identity.generate()
    path = tmp_path / "identity.key"
    identity.save(path)

    private = crypto_pb2.PrivateKey.FromString(path.read_bytes())
    assert private.key_type == crypto_pb2.KeyType.Ed25519
    assert private.data[32:] == identity.public_key_bytes
    public = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.Ed25519, data=private.data[32:])
    digest = multihash.encode(public.SerializeToString(), 0x00)  # identity hash
    assert hivemind_p2p.PeerID(digest).to_base58() == identity.peer_id


def test_p2p_daemon_reports_the_same_peer_id(tmp_path: Path) -> None:
    # hivemind's PeerID.from_identity only parses RSA keys, so ask the daemon itself.
    hivemind_p2p = pytest.importorskip("hivemind.p2p")
    identity = Identity.generate()
    path = tmp_path / "identity.key"
    identity.save(path)

    async def daemon_peer_id() -> str:
        p2p = await hivemind_p2p.P2P.create(identity_path=str(path), no_listen=True)
        try:
            return p2p.peer_id.to_base58()
        finally:
            await p2p.shutdown()

    assert asyncio.run(daemon_peer_id()) == identity.peer_id


def test_a_created_key_file_is_private(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "identity.key"
    Identity.load_or_create(path)
    assert path.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_a_key_file_others_may_read_is_refused_in_one_line(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "identity.key"
    Identity.generate().save(path)
    path.chmod(mode)

    with pytest.raises(IdentityError, match="readable by other users") as excinfo:
        Identity.load(path)
    assert "chmod 600" in str(excinfo.value) and "\n" not in str(excinfo.value)


def test_a_token_file_gives_its_first_line_and_must_be_private(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("s3cret\n")
    path.chmod(0o600)
    assert read_secret_file(path, "token file") == "s3cret"
    path.chmod(0o644)
    with pytest.raises(IdentityError, match="readable by other users"):
        read_secret_file(path, "token file")
    with pytest.raises(IdentityError, match="could not be read"):
        read_secret_file(tmp_path / "absent", "token file")
