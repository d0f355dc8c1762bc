"""`diloco-node doctor`'s verdict: a pure function of what the probe observed."""

from __future__ import annotations

from dht.doctor import BootstrapProbe, Observation, Verdict, is_public_maddr

ME = "12D3KooWBxYvqyB4166XfVJ7jZ42vgPrzKAvWbkc1NwvK3i49tFK"
RELAY = "12D3KooWNdCAR3NwA13FW74d2hURfeBQ4RaTmTorkqWxQcvHGnZw"
BOOT = f"/ip4/11.64.0.10/tcp/4100/p2p/{RELAY}"
LAN = f"/ip4/192.168.1.10/tcp/36467/p2p/{ME}"
CIRCUIT = f"{BOOT}/p2p-circuit/p2p/{ME}"


def test_a_public_node_is_told_peers_dial_it_and_nothing_to_change() -> None:
    seen = Observation(
        bootstraps=[BootstrapProbe(BOOT, "ok")],
        nat_status="public",
        announced=[f"/ip4/11.64.0.20/tcp/4200/p2p/{ME}"],
        port=4200,
    )
    verdict = Verdict(seen)
    assert verdict.kind == "public" and verdict.ok
    text = "\n".join(verdict.lines())
    assert "reachability: public" in text and "to change" not in text


def test_a_nated_node_with_a_relay_slot_names_its_relay_and_how_to_be_direct() -> None:
    seen = Observation(
        bootstraps=[BootstrapProbe(BOOT, "ok")],
        nat_status="private",
        announced=[LAN, CIRCUIT],
        port=36467,
    )
    verdict = Verdict(seen)
    assert verdict.kind == "relayed" and verdict.ok
    lines = verdict.lines()
    assert f"behind a NAT, reachable through relay {RELAY}" in lines[1]
    assert CIRCUIT in lines[2]
    assert "forward TCP port 36467" in lines[3]


def test_a_nated_node_without_a_relay_is_told_nobody_can_reach_it_and_what_to_do() -> None:
    seen = Observation(bootstraps=[BootstrapProbe(BOOT, "ok")], nat_status="private",
                       announced=[LAN], port=36467)  # fmt: skip
    verdict = Verdict(seen)
    assert verdict.kind == "unreachable" and not verdict.ok
    text = "\n".join(verdict.lines())
    assert "no peer can reach it" in text and "--auto-relay" in text


def test_every_failed_bootstrap_is_named_with_why() -> None:
    seen = Observation(
        bootstraps=[
            BootstrapProbe(BOOT, "refused", "nothing listens on 11.64.0.10 port 4100"),
            BootstrapProbe(BOOT.replace("4100", "4101"), "wrong peer id", "not it"),
            BootstrapProbe(BOOT.replace("4100", "4102"), "timed out", "no answer"),
        ],
        announced=[LAN],
    )
    verdict = Verdict(seen)
    assert verdict.kind == "no bootstrap" and not verdict.ok
    lines = verdict.lines()
    assert lines[0].endswith("refused (nothing listens on 11.64.0.10 port 4100)")
    assert "wrong peer id" in lines[1] and "timed out" in lines[2]
    assert "check --peers" in lines[-1]


def test_one_answering_bootstrap_is_enough() -> None:
    seen = Observation(
        bootstraps=[BootstrapProbe(BOOT, "refused"), BootstrapProbe(BOOT, "ok")],
        nat_status="public",
    )
    assert Verdict(seen).kind == "public"


def test_only_global_ip_addresses_are_public() -> None:
    assert is_public_maddr("/ip4/11.64.0.10/tcp/1")
    for private in (LAN, "/ip4/127.0.0.1/tcp/1", "/ip4/100.64.0.1/tcp/1", CIRCUIT, "/dns/x/tcp/1"):
        assert not is_public_maddr(private)
