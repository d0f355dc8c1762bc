"""`--allow-keys FILE`: who may contribute to a permissioned run, and under which organization."""

from __future__ import annotations

from pathlib import Path

import pytest

from merge.allowlist import AllowList, AllowListError
from merge.identity import Identity

A, B, C = (Identity.generate() for _ in range(3))


def test_toml_maps_organizations_to_peer_ids_and_public_keys(tmp_path: Path) -> None:
    path = tmp_path / "allow.toml"
    path.write_text(f'"lab-a" = ["{A.peer_id}"]\n"lab-b" = ["{B.public_key_bytes.hex()}"]\n')
    allow = AllowList.load(path)

    assert allow.allows(A.peer_id) and allow.allows(B.peer_id) and not allow.allows(C.peer_id)
    assert allow.org_of(A.peer_id) == "lab-a" and allow.org_of(B.peer_id) == "lab-b"
    assert allow.org_of(C.peer_id) is None


def test_yaml_works_too(tmp_path: Path) -> None:
    path = tmp_path / "allow.yaml"
    path.write_text(f"lab-a:\n  - {A.peer_id}\n  - {B.peer_id}\n")
    assert AllowList.load(path).orgs == {A.peer_id: "lab-a", B.peer_id: "lab-a"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('"lab" = "not a list"', "needs a list of keys"),
        ('"lab" = ["12D3KooWnope"]', "neither a peer id nor"),
        ("not toml at all [", "not valid TOML"),
        ("", "expected organization names"),
        (f'"a" = ["{A.peer_id}"]\n"b" = ["{A.peer_id}"]', "under two organizations"),
    ],
    ids=["not_a_list", "bad_key", "not_toml", "empty", "key_twice"],  # same on every collection
)
def test_a_bad_file_is_one_clear_error_naming_it(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "allow.toml"
    path.write_text(text)
    with pytest.raises(AllowListError, match=message) as raised:
        AllowList.load(path)
    assert str(path) in str(raised.value) and "\n" not in str(raised.value)


def test_a_missing_file_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(AllowListError, match="could not be read"):
        AllowList.load(tmp_path / "absent.toml")
