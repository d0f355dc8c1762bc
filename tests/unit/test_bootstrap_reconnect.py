"""When a running node dials its bootstrap peers again and reserves relay slots itself
(dht.bootstrap_reconnect), and the relay's answer it reads (dht.p2pd.hop_status)."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dht.bootstrap_reconnect import (
    NAT_GRACE_S,
    RESERVATION_REFRESH_S,
    RESERVATION_RETRY_S,
    ReconnectPolicy,
)
from dht.bootstrap_retry import RejoinBounds
from dht.p2pd import HOP_STATUS_OK, RESERVE_REQUEST, hop_status

IDS = [
    "12D3KooWGgtHxHyqJ2bBHB6YPBFu2yC7n1AVXsbuXrBjVt3jxY3E",
    "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo",
    "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
]
BOOT = f"/ip4/10.0.0.1/tcp/4100/p2p/{IDS[0]}"
OTHER_BOOT = f"/ip4/10.0.0.2/tcp/4100/p2p/{IDS[1]}"
KNOWN = f"/ip4/192.168.1.5/tcp/3000/p2p/{IDS[2]}"


def policy(*, wants_relay: bool = True, bootstraps: list[str] | None = None) -> ReconnectPolicy:
    boots = [BOOT] if bootstraps is None else bootstraps
    return ReconnectPolicy(boots, [*boots, KNOWN], wants_relay=wants_relay, now=0.0)


def test_a_node_connected_to_its_bootstrap_dials_nobody() -> None:
    p = policy()
    for t in range(30):
        assert p.plan(float(t), table_size=3, connected={IDS[0]}, relays=set()).dial == ()


def test_losing_the_bootstrap_dials_it_at_once_then_every_1_2_3_s() -> None:
    """p2pd's own dial backoff spaces the real dials (dht.bootstrap_retry.RejoinBounds)."""
    p = policy()
    p.plan(0.0, table_size=3, connected={IDS[0]}, relays=set())
    dialled_at = []
    for tick in range(60):
        now = 1.0 + tick
        plan = p.plan(now, table_size=3, connected={IDS[2]}, relays=set())
        if plan.dial:
            assert plan.dial == (BOOT,)  # the bootstrap only: the swarm is still there
            dialled_at.append(now)
            p.dialled(now, reached=False)
    gaps = [b - a for a, b in zip(dialled_at, dialled_at[1:], strict=False)]
    assert dialled_at[0] == 1.0
    assert gaps[:6] == [1.0, 2.0, 3.0, 3.0, 3.0, 3.0]


def test_an_empty_routing_table_dials_every_known_peer() -> None:
    plan = policy().plan(0.0, table_size=0, connected=set(), relays=set())
    assert plan.dial == (BOOT, KNOWN)


def test_a_restarted_relay_is_asked_for_a_slot_once_reconnected_and_again_after_each_loss() -> None:
    p = policy()
    # autorelay reserved a slot with the bootstrap: behind NAT, nothing to do
    assert p.plan(0.0, table_size=2, connected={IDS[0]}, relays={IDS[0]}).reserve_with is None
    # the relay died: not connected, nobody to ask; it is dialled
    plan = p.plan(1.0, table_size=2, connected=set(), relays=set())
    assert plan.reserve_with is None and plan.dial == (BOOT,)
    p.dialled(1.0, reached=True)
    # back on the same address (autorelay will not ask it again for an hour): this node asks
    plan = p.plan(2.0, table_size=2, connected={IDS[0]}, relays=set())
    assert plan.reserve_with == IDS[0] and plan.dial == ()
    p.reservation(IDS[0], 2.0, ok=True)
    assert p.plan(3.0, table_size=2, connected={IDS[0]}, relays=set()).reserve_with is None
    # renewed before the relay's hour is over
    later = 2.0 + RESERVATION_REFRESH_S
    assert p.plan(later, table_size=2, connected={IDS[0]}, relays=set()).reserve_with == IDS[0]
    p.reservation(IDS[0], later, ok=True)
    # the relay restarts again: the slot went with the connection
    p.plan(later + 1, table_size=2, connected=set(), relays=set())
    assert p.plan(later + 2, table_size=2, connected={IDS[0]}, relays=set()).reserve_with == IDS[0]


def test_a_public_node_or_one_without_auto_relay_never_reserves() -> None:
    for p, public in ((policy(), True), (policy(wants_relay=False), False)):
        for t in range(120):
            relays = {IDS[0]} if t == 0 and not public else set()
            plan = p.plan(t, table_size=2, connected={IDS[0]}, relays=relays, public_address=public)
            assert plan.reserve_with is None


def test_a_home_that_never_got_a_slot_reserves_one_itself_after_the_grace() -> None:
    """Restarted while its relay was down, autorelay tried the relay then (and waits an hour)."""
    p = policy()
    for t in range(int(NAT_GRACE_S)):
        assert p.plan(float(t), table_size=2, connected={IDS[0]}, relays=set()).reserve_with is None
    assert (
        p.plan(NAT_GRACE_S, table_size=2, connected={IDS[0]}, relays=set()).reserve_with == IDS[0]
    )


def test_a_refused_reservation_is_retried_after_a_pause() -> None:
    p = policy()
    p.plan(0.0, table_size=2, connected={IDS[0]}, relays={IDS[0]})
    assert p.plan(1.0, table_size=2, connected={IDS[0]}, relays=set()).reserve_with == IDS[0]
    p.reservation(IDS[0], 1.0, ok=False)
    assert p.plan(2.0, table_size=2, connected={IDS[0]}, relays=set()).reserve_with is None
    retry = 1.0 + RESERVATION_RETRY_S
    assert p.plan(retry, table_size=2, connected={IDS[0]}, relays=set()).reserve_with == IDS[0]


def test_addresses_without_a_peer_id_are_left_out() -> None:
    p = ReconnectPolicy(["/ip4/10.0.0.1/tcp/1", "nonsense", BOOT], [], wants_relay=False, now=0)
    assert p.bootstrap_ids == [IDS[0]]


observation_st = st.tuples(
    st.integers(0, 3),  # routing table size
    st.sets(st.sampled_from(IDS)),  # connected peers
    st.sets(st.sampled_from(IDS[:2])),  # autorelay's relays
    st.floats(0.05, 2.0),  # time to the next tick
    st.booleans(),  # a dial reaches a peer
    st.booleans(),  # a relay grants a slot
    st.booleans(),  # p2pd lists a public address of this node
)


@given(st.lists(observation_st, min_size=1, max_size=120), st.booleans())
def test_dials_and_reservations_happen_only_when_needed_and_within_bounds(
    steps: list[tuple[int, set[str], set[str], float, bool, bool, bool]], wants_relay: bool
) -> None:
    """Dials only when alone or cut from every bootstrap, never sooner than the first delay
    after a failed one, and a bootstrap lost for good is dialled at least every cap + a tick.
    Reservations only behind NAT (autorelay held a slot once, or no public address after the
    grace) while autorelay holds none, with a
    connected bootstrap, never while a granted one is live, never twice in RESERVATION_RETRY_S."""
    bounds = RejoinBounds()
    p = ReconnectPolicy([BOOT, OTHER_BOOT], [KNOWN], wants_relay=wants_relay, now=0.0)
    boots = set(IDS[:2])
    now, last_dial, behind_nat = 0.0, None, False
    held: dict[str, float] = {}  # relay -> when granted, while connected
    asked: dict[str, float] = {}
    for table, connected, relays, advance, reached, granted, public in steps:
        held = {r: t for r, t in held.items() if r in connected}
        needed = table == 0 or not (connected & boots)
        plan = p.plan(
            now, table_size=table, connected=connected, relays=relays, public_address=public
        )
        if plan.dial:
            assert needed
            assert set(plan.dial) == ({KNOWN} if table == 0 else {BOOT, OTHER_BOOT})
            if last_dial is not None:
                assert now - last_dial >= bounds.first_delay_s - 1e-9
            last_dial = now
            p.dialled(now, reached=reached)
        elif needed and last_dial is not None:
            assert now - last_dial < bounds.max_delay_s + 1e-9
        if not needed:
            last_dial = None  # connected: the next loss dials at once
        nat_now = bool(relays) or (not public and now >= NAT_GRACE_S)
        behind_nat = behind_nat or (wants_relay and nat_now)
        if plan.reserve_with is not None:
            relay = plan.reserve_with
            assert wants_relay and behind_nat and not relays
            assert relay in connected & boots
            assert not any(now - t < RESERVATION_REFRESH_S for t in held.values())
            if relay in asked:  # refused last time
                assert now - asked[relay] >= RESERVATION_RETRY_S - 1e-9
            asked[relay] = now
            p.reservation(relay, now, ok=granted)
            if granted:
                held[relay] = now
                asked.pop(relay)
        now += advance


def test_a_granted_reservation_reads_ok() -> None:
    # HopMessage{type: STATUS, reservation: {expire: 1700000000, addrs: [..]}, status: OK}
    reservation = b"\x08\x80\xe2\xcf\xaa\x06\x12\x04abcd"
    answer = b"\x08\x02" + b"\x1a" + bytes([len(reservation)]) + reservation + b"\x28\x64"
    assert hop_status(answer) == HOP_STATUS_OK
    assert hop_status(b"\x08\x02\x28\xc8\x01") == 200  # RESERVATION_REFUSED
    assert bytes([2]) + b"\x08\x00" == RESERVE_REQUEST  # length 2, then type RESERVE


@given(st.binary(max_size=64))
def test_any_answer_gives_a_status_or_value_error(blob: bytes) -> None:
    with contextlib.suppress(ValueError):
        assert hop_status(blob) >= 0


@pytest.mark.parametrize("blob", [b"\x28", b"\x1a\x05ab", b"\x0b", b"\x28\xff\xff"])
def test_truncated_or_unknown_answers_are_refused(blob: bytes) -> None:
    with pytest.raises(ValueError):
        hop_status(blob)
