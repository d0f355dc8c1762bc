"""A joining node's reachability lines and its bootstrap failure sentence (pure)."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from dht.doctor import BootstrapProbe
from dht.join_report import ReachabilityNotes, bootstrap_failure, ip_of, reachability

ME = "12D3KooWBxYvqyB4166XfVJ7jZ42vgPrzKAvWbkc1NwvK3i49tFK"
RELAY = "12D3KooWNdCAR3NwA13FW74d2hURfeBQ4RaTmTorkqWxQcvHGnZw"
BOOT = f"/ip4/11.64.0.10/tcp/4100/p2p/{RELAY}"
LOOP = f"/ip4/127.0.0.1/tcp/36467/p2p/{ME}"
LAN = f"/ip4/192.168.1.10/tcp/36467/p2p/{ME}"
PUBLIC = f"/ip4/11.64.0.20/tcp/4200/p2p/{ME}"
CIRCUIT = f"{BOOT}/p2p-circuit/p2p/{ME}"
NAT: dict[str, Any] = {"announce_given": False, "use_auto_relay": True}


def test_a_nated_node_names_its_relay_once_it_holds_a_slot() -> None:
    waiting = reachability([LOOP, LAN], **NAT)
    assert "waiting for a relay slot" in waiting.line and waiting.announced == [LAN]
    relayed = reachability([LOOP, LAN, CIRCUIT], **NAT)
    assert relayed.line == f"behind a NAT, reachable through relay {RELAY}"
    assert relayed.relays == [RELAY] and relayed.announced == [LAN, CIRCUIT]


def test_an_announced_node_is_public_and_an_unannounced_public_address_is_unconfirmed() -> None:
    told = reachability([PUBLIC], announce_given=True, use_auto_relay=False)
    assert told.line.startswith("public")
    guessed = reachability([LOOP, PUBLIC], announce_given=False, use_auto_relay=False)
    assert PUBLIC in guessed.line and "not confirmed" in guessed.line and "doctor" in guessed.line


def test_a_node_with_local_addresses_only_is_told_what_to_change() -> None:
    line = reachability([LOOP, LAN], announce_given=False, use_auto_relay=False).line
    assert "cannot reach it" in line and "--auto-relay" in line and "--announce" in line


def test_a_verdict_is_told_first_and_then_only_when_it_changes() -> None:
    notes = ReachabilityNotes(**NAT)
    assert "waiting" in notes.first([LAN]).line
    assert notes.update([LAN]) is None
    taken = notes.update([LAN, CIRCUIT])
    assert taken is not None and RELAY in taken.line
    assert notes.update([CIRCUIT, LAN]) is None  # same relay, other order
    lost = notes.update([LAN])
    assert lost is not None and "waiting" in lost.line


@given(st.lists(st.sampled_from([LOOP, LAN, PUBLIC, CIRCUIT]), max_size=6), st.booleans())
def test_every_address_set_gets_one_line_and_loopback_is_never_announced(
    own: list[str], auto_relay: bool
) -> None:
    found = reachability(own, announce_given=False, use_auto_relay=auto_relay)
    assert found.line and "\n" not in found.line
    assert LOOP not in found.announced
    assert (RELAY in found.line) == (CIRCUIT in own)


def test_a_bootstrap_failure_names_each_failed_address_and_why() -> None:
    wrong = BOOT.replace("4100", "4101")
    sentence = bootstrap_failure(
        [
            BootstrapProbe(BOOT, "refused", "nothing listens on 11.64.0.10 port 4100"),
            BootstrapProbe(wrong, "wrong peer id", f"the node at that address is not {RELAY}"),
            BootstrapProbe(BOOT.replace("4100", "4102"), "ok"),
        ]
    )
    assert f"{BOOT}: refused (nothing listens on 11.64.0.10 port 4100)" in sentence
    assert f"{wrong}: wrong peer id (the node at that address is not {RELAY})" in sentence
    assert "4102" not in sentence


ROUTER = f"/ip4/11.64.0.100/tcp/44339/p2p/{ME}"  # identify's observed address: the cone NAT's
HOME_IPS = {"127.0.0.1", "192.168.1.10"}


def test_a_home_whose_router_address_was_observed_is_behind_a_nat_not_public() -> None:
    """With 4 public peers p2pd lists the router's address before the relay slot comes."""
    line = reachability([LOOP, LAN, ROUTER], **NAT, local_ips=HOME_IPS).line
    assert line.startswith("behind a NAT (peers see it at /ip4/11.64.0.100/tcp/44339")
    assert "waiting for a relay slot" in line and "public address" not in line
    bare = reachability(
        [LAN, ROUTER], announce_given=False, use_auto_relay=False, local_ips=HOME_IPS
    )
    assert bare.line.startswith("behind a NAT") and "--auto-relay" in bare.line
    slot = reachability([LAN, ROUTER, CIRCUIT], **NAT, local_ips=HOME_IPS)
    assert slot.line == f"behind a NAT, reachable through relay {RELAY}"


def test_a_public_address_on_its_own_interface_stays_unconfirmed() -> None:
    own = reachability([LOOP, PUBLIC], **NAT, local_ips={"127.0.0.1", "11.64.0.20"})
    assert own.line.startswith("a public address") and "not confirmed" in own.line
    unknown = reachability([LOOP, ROUTER], **NAT)  # interfaces unknown: as before
    assert unknown.line.startswith("a public address")


def test_the_notes_read_this_machines_interfaces_once() -> None:
    notes = ReachabilityNotes(**NAT)
    assert "127.0.0.1" in notes._local_ips
    assert notes.first([LOOP, LAN, ROUTER]).line.startswith("behind a NAT")
    assert ip_of(ROUTER) == "11.64.0.100" and ip_of(CIRCUIT) == "11.64.0.10"
    assert ip_of("/dns4/example.org/tcp/1") == ""
