"""A fetch round that falls back (dht.group_exchange_candidates `_fall_back`; docs/scale.md,
Session 18): every member fetches the ids all of them proposed whole and applies them in id
order, whatever order the fetches end in, so members at one state stay at one state (in the
gossip's arrival order Delayed Nesterov folds other batches on each: session 17's members of
one applied set 1e-3 apart); from the first id not fetched on, and every other candidate, to
the gossip."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

from dht.group_exchange import GroupExchange
from dht.grouping_wire import encode_update
from dht.shard_fetch_inbox import Fallback, Inbox
from dht.shard_fetch_wire import FetchMessage, decode_fetch
from merge.group_update import GroupUpdate
from merge.identity import Identity
from tests.unit.shard_round_paths import NUMEL, Spec, _everyone, _pipeline, _update
from tests.unit.test_shard_member import _fetch, _rounds, _setup

UPDATES = [_update(Spec(1, r, "honest", 0, 0), 3, 2) for r in range(4)]
"""Group 0b1's updates of rounds 0-3 (seqs 1-4), two learners: a fold every two."""


def _uid(update: GroupUpdate) -> tuple[str, int]:
    return update.head.group_key, update.seq


def _exchange(
    missing: set[int], applied: list[tuple[str, int]], offers: list[tuple[str, int, str]]
) -> GroupExchange:
    pipeline = _pipeline("delayed_nesterov")
    by_seq = {u.seq: u for u in UPDATES}

    async def fetch(peer: str, key: str, seq: int, cause: str = "") -> bytes | None:
        await asyncio.sleep(0.01 * (10 - seq))  # later ids arrive first
        return None if seq in missing else encode_update(by_seq[seq])

    def on_update(update: GroupUpdate) -> bool:
        applied.append(_uid(update))
        return pipeline.submit_group(update, _everyone).accepted

    async def retain(update: GroupUpdate) -> None:
        return None

    network = SimpleNamespace(identity=Identity.generate(), config=SimpleNamespace(run_id="r"))
    exchange = GroupExchange(
        network,  # type: ignore[arg-type]
        numel=NUMEL,
        reject=lambda *_: None,
        is_alive=lambda _: True,
        offer=lambda key, seq, holder, cause="": offers.append((key, seq, holder)),
        fetch=fetch,
        on_update=on_update,
        retain=retain,
        shard_fetch=pipeline.groups,
    )
    for update in UPDATES:
        exchange.candidate(*_uid(update), "holder")
    exchange.candidate("groups.0b10", 1, "other")  # not every member's: the next round's
    return exchange


def _fall_back(missing: set[int]) -> tuple[int, list, list, GroupExchange]:
    applied: list[tuple[str, int]] = []
    offers: list[tuple[str, int, str]] = []

    async def run() -> tuple[int, GroupExchange]:
        exchange = _exchange(missing, applied, offers)
        ids = tuple(sorted(_uid(u) for u in UPDATES))
        holders = {uid: ("holder",) for uid in ids}
        return await exchange._fall_back(ids, holders), exchange

    num, exchange = asyncio.run(run())
    return num, applied, offers, exchange


def test_members_falling_back_apply_the_agreed_ids_in_id_order() -> None:
    """What not every member proposed stays a candidate of the next round (session 22 handed
    it to the gossip at once: fetched whole at a moment of each member's own)."""
    num, applied, offers, exchange = _fall_back(set())
    assert num == 4 and applied == sorted(_uid(u) for u in UPDATES)
    assert offers == [] and list(exchange._candidates) == [("groups.0b10", 1)]


def test_the_first_id_not_fetched_and_the_rest_stay_candidates_of_the_next_round() -> None:
    num, applied, offers, exchange = _fall_back({3})
    assert num == 2 and applied == [_uid(UPDATES[0]), _uid(UPDATES[1])]
    key = UPDATES[0].head.group_key
    assert offers == []
    assert sorted(exchange._candidates) == sorted([(key, 3), (key, 4), ("groups.0b10", 1)])


def test_two_members_falling_back_alike_end_bit_for_bit_alike() -> None:
    """What the gossip's arrival order would not give (merge: one set, two orders)."""
    replicas = []
    for _ in range(2):
        exchange = _fall_back(set())[3]
        assert exchange._merge is not None
        replicas.append(exchange._merge.pipeline.replica)
    assert torch.equal(replicas[0].params, replicas[1].params)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            replicas[0].outer.state_tensors(), replicas[1].outer.state_tensors(), strict=True
        )
    )


def test_a_replica_that_moved_under_the_round_fails_it_as_moved_not_as_a_state_lie() -> None:
    """Session 18's three `gram_wrong_state` rounds at a state gap of 0: the member's own
    group's next update applied between the proposals and the parts. Now "replica_moved"
    (nobody's fault) on whichever side moved, and no part of the moved state is sent."""
    for side in ("sender", "receiver"):
        pipelines, _, updates = _setup(False)
        rounds = _rounds(pipelines, updates)
        _fetch(rounds)
        moved = 0 if side == "sender" else 1
        pipelines[moved].submit_group(_update(Spec(4, 3, "honest", 0, 0), 9, 16), _everyone)
        part = rounds[0].part()
        if side == "sender":
            assert part is None and rounds[0].failed == "replica_moved"
        else:
            assert part is not None
            assert not rounds[1].part_from(rounds[0].me, part)
            assert rounds[1].failed == "replica_moved"


def test_a_members_abort_ends_the_others_wait_and_a_strangers_does_not() -> None:
    async def run() -> None:
        me = Identity.generate()
        inbox = Inbox()
        abort = FetchMessage("r", ("groups.0b0", 0, 1), "abort", "stranger", {"reason": "x"}, ())
        inbox.put(abort)
        with pytest.raises(Fallback, match="part_missing"):
            await inbox.wait("part", ["peer"], time.monotonic() + 0.05)
        signed = FetchMessage("r", ("groups.0b0", 0, 1), "abort", me.peer_id, {"reason": "x"}, ())
        blob = signed.signed(me).to_bytes()
        inbox.put(decode_fetch(blob, NUMEL))
        started = time.monotonic()
        with pytest.raises(Fallback, match="aborted"):
            await inbox.wait("part", [me.peer_id], time.monotonic() + 5.0)
        assert time.monotonic() - started < 1.0

    asyncio.run(run())


def test_a_slice_fetched_for_a_deferred_update_is_reused_by_the_next_round() -> None:
    """An update deferred past a fold is in the next round's set with the same members and
    slice: its checked slice is kept (at most two models' values, applied ones dropped)."""

    async def run() -> None:
        exchange = _exchange(set(), [], [])
        asked: list[tuple[str, int]] = []
        applied: set[tuple[str, int]] = set()

        async def ask(
            holder: str, uid: tuple[str, int], start: int, end: int, unreachable: object = None
        ) -> tuple:
            asked.append(uid)
            return UPDATES[0], torch.zeros(end - start)

        exchange._ask_slice = ask  # type: ignore[method-assign]
        exchange._applied = lambda uid: uid in applied  # type: ignore[method-assign]
        uids = [_uid(u) for u in UPDATES]
        for _ in range(2):
            await exchange._fetch_one(uids[0], ("holder",), 0, NUMEL // 2)
        assert asked == [uids[0]] and exchange.num_slices_reused == 1
        await exchange._fetch_one(uids[0], ("holder",), NUMEL // 2, NUMEL)  # another slice
        assert len(asked) == 2
        applied.add(uids[0])
        for uid in uids[1:]:  # whole-model slices: two kept, the applied ones dropped
            await exchange._fetch_one(uid, ("holder",), 0, NUMEL)
        assert [key[0] for key in exchange._slices] == uids[2:]

    asyncio.run(run())
