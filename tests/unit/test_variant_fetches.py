"""Two honest variants of one group round meet (dht.variant_fetches, session 26): a
`group-done` notice names its variant; a replica that holds another variant of the round
fetches the named one once, the merge makes the proof, and every replica settles it alike,
whichever variant it applied and in whichever order the notices came. Before, an applied id
was never fetched again: replicas kept two points at one applied set."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dht.group_exchange_reads as ge  # where the exchange reads a stream
from dht.group_exchange import GroupExchange
from dht.group_notice import NOTICE_MAGIC, SignedDone, decode_notice
from dht.grouping import member_check
from dht.grouping_done import Done, decode_done
from dht.grouping_wire import GroupMessageError, RoundId, encode_update
from dht.variant_fetches import (
    MAX_VARIANTS_FETCHED,
    VariantFetches,
    is_digest,
    served_refusal,
)
from merge.group_equivocation import GroupProof, GroupVariant, variant_digest
from merge.group_update import GroupUpdate
from merge.identity import Identity
from merge.pipeline import UpdatePipeline
from tests.unit.test_group_equivocation import _apply, _pipeline, _retained
from tests.unit.test_group_merge import IDS, NUMEL, RUN, _update

# Two disjoint halves of the root group each complete round 2 (start-up, before the census
# holds every peer): as many members each, so neither prevails and the round is voided.
LEFT, RIGHT = _update([IDS[0], IDS[2]]), _update([IDS[1], IDS[3]], scale=2.0)
# Three against one: the three's variant prevails everywhere.
MORE, FEWER = _update(IDS[:3], scale=3.0), _update([IDS[3]], scale=5.0)
PAIRS = {"tie": (LEFT, RIGHT), "more": (MORE, FEWER)}
RID: RoundId = (LEFT.head.group_key, LEFT.head.epoch, LEFT.head.round)
UID = (LEFT.head.group_key, LEFT.seq)


def _digest(update: GroupUpdate) -> str:
    return GroupVariant.of(update).digest


def test_a_notice_names_its_variant_and_two_variants_have_two_names() -> None:
    assert Done.of(LEFT).variant == _digest(LEFT) == variant_digest(GroupVariant.of(LEFT).key)
    assert is_digest(_digest(LEFT)) and _digest(LEFT) != _digest(RIGHT)
    assert _digest(LEFT) == GroupVariant.of(LEFT).digest  # a copy has the same name
    done = Done.of(LEFT)
    assert decode_done(done.to_bytes()) == done


def test_a_signed_notice_carries_its_variant_and_an_old_one_still_parses() -> None:
    signed = SignedDone.of(Done.of(LEFT), IDS[0], RUN)
    back = decode_notice(signed.to_bytes())
    assert back == signed and back.verified() and back.done.variant == _digest(LEFT)
    # A notice of session 25 (no variant): parses, verifies, names none.
    fields = json.loads(signed.to_bytes()[4:])
    del fields["variant"]
    old = decode_notice(NOTICE_MAGIC + json.dumps(fields).encode())
    assert old.done.variant is None and old.verified()
    # The digest is outside the signed statement: a node of session 25 verifies a new notice.
    assert replace(signed, done=replace(signed.done, variant=None)).verified()


def test_a_notice_with_a_variant_out_of_shape_is_refused() -> None:
    signed = SignedDone.of(Done.of(LEFT), IDS[0], RUN)
    for bad in ("XYZ", "0" * 64, 7, ["a"], "ABCDEF0123456789"):
        fields = json.loads(signed.to_bytes()[4:])
        fields["variant"] = bad
        blob = NOTICE_MAGIC + json.dumps(fields).encode()
        try:
            decode_notice(blob)
        except GroupMessageError as exc:
            assert exc.reason == "malformed"
        else:
            raise AssertionError(f"a variant of {bad!r} parsed")


def test_each_named_variant_is_fetched_once_and_a_round_at_most_twice() -> None:
    book, held = VariantFetches(), _digest(LEFT)
    assert book.decide(RID, None, _digest(RIGHT)) == "wait"  # nothing held yet
    assert book.decide(RID, held, None) == "unnamed"  # a session 25 notice
    assert book.decide(RID, held, held) == "same"
    assert book.decide(RID, held, _digest(RIGHT)) == "fetch"
    assert book.decide(RID, held, _digest(RIGHT)) == "fetched"  # once
    bogus = [f"{n:016x}" for n in range(5)]
    assert [book.decide(RID, held, b) for b in bogus[:2]] == ["fetch", "capped"]
    assert len(book.fetched(RID)) == MAX_VARIANTS_FETCHED
    other: RoundId = (RID[0], RID[1], RID[2] + 1)
    assert book.decide(other, held, bogus[3]) == "fetch"  # another round's own budget


def test_watching_is_bounded_per_round_and_in_all() -> None:
    book = VariantFetches()
    names = [f"{n:016x}" for n in range(MAX_VARIANTS_FETCHED + 2)]
    assert [book.watch(RID, n) for n in names] == ["ok"] * (MAX_VARIANTS_FETCHED + 1) + ["capped"]
    assert book.watch(RID, names[0]) == "duplicate"
    book.unwatch(RID, names[0])
    assert book.watch(RID, names[0]) == "ok"
    for n in names:
        book.unwatch(RID, n)
    assert book.watch(RID, names[-1]) == "ok"


def test_a_served_update_that_is_not_the_variant_named_is_counted() -> None:
    rid_right: RoundId = (RIGHT.head.group_key, RIGHT.head.epoch, RIGHT.head.round)
    assert served_refusal(RID, _digest(RIGHT), rid_right, _digest(RIGHT)) is None
    assert served_refusal(RID, "0" * 16, rid_right, _digest(RIGHT)) == "group_done_wrong_variant"
    later: RoundId = (RID[0], RID[1], RID[2] + 1)
    assert served_refusal(later, _digest(RIGHT), RID, _digest(RIGHT)) == "group_done_wrong_round"


class _Node:
    """A replica with the notice rule: what the gossip brings first is applied, each notice
    naming another variant than the one held fetches it once (`VariantFetches`), a second
    variant refused by the merge makes the proof, and a proof learned is settled and passed
    on (the wiring: dht.group_exchange_done, node.network_swarm, dht.gossip_evidence)."""

    def __init__(self, pair: tuple[GroupUpdate, GroupUpdate]) -> None:
        self.pipeline: UpdatePipeline = _pipeline()
        self.book, self.pair = VariantFetches(), pair
        self.applied: GroupUpdate | None = None
        self.waiting: list[GroupUpdate] = []
        self.num_fetched = 0
        self.proofs: list[GroupProof] = []

    def held(self) -> str | None:
        key = self.pipeline.groups.variants.key_of(UID)
        return None if key is None else variant_digest(key)

    def gossip_brings(self, update: GroupUpdate) -> None:
        if _apply(self.pipeline, update):
            self.applied = update
        for waiting in self.waiting:  # notices that waited for a variant held here
            self.notice(waiting)
        self.waiting.clear()

    def notice(self, named: GroupUpdate) -> None:
        decision = self.book.decide(RID, self.held(), _digest(named))
        if decision == "wait":
            self.waiting.append(named)
        if decision != "fetch":
            return
        self.num_fetched += 1
        result = self.pipeline.submit_group(named, member_check(RUN, named.head.group_key))
        if result.reason == "group_equivocation":
            proof = self.pipeline.group_evidence(named)
            assert proof is not None
            self.learn(proof)

    def learn(self, proof: GroupProof) -> None:
        action = self.pipeline.learn_group_proof(proof, _retained(self.applied))
        if action != "none":
            self.proofs.append(proof)  # passed on
        kept = proof.prevailing
        for _ in self.pipeline.equivocation.awaiting():  # dht.gossip_fetch `fetch_awaited`
            assert kept is not None
            prevailing = next(u for u in self.pair if GroupVariant.of(u) == kept)
            assert _apply(self.pipeline, prevailing)


ARRIVALS = st.lists(
    st.tuples(st.sampled_from([0, 1]), st.permutations(["gossip", "notice0", "notice1"])),
    min_size=2,
    max_size=4,
)


@settings(max_examples=25, deadline=None)
@given(pair=st.sampled_from(sorted(PAIRS)), arrivals=ARRIVALS)
def test_every_replica_ends_with_one_applied_set_and_one_verdict(
    pair: str, arrivals: list[tuple[int, list[str]]]
) -> None:
    """Each replica is brought one variant by the gossip (either) and hears both notices, in
    its own order; proofs are passed on to every replica. All end with the same applied
    set, the same verdict (voided on a tie; the variant with more members kept), the same
    params; each fetched at most one variant for a notice."""
    variants = PAIRS[pair]
    nodes = [_Node(variants) for _ in arrivals]
    for node, (first, order) in zip(nodes, arrivals, strict=True):
        for event in order:
            if event == "gossip":
                node.gossip_brings(variants[first])
            else:
                node.notice(variants[int(event[-1])])
    sent = [p for node in nodes for p in node.proofs]
    if len({first for first, _ in arrivals}) > 1:
        assert sent  # two variants applied: they met somewhere
    for proof in sent:  # passed on: every replica learns every proof, once or again
        for node in nodes:
            node.learn(proof)
    alone = _pipeline()
    kept = variants[0] if pair == "more" else None
    if kept is not None:
        assert _apply(alone, kept)
    for node in nodes:
        assert node.num_fetched <= 1
        assert node.pipeline.replica.has_applied(*UID)
        assert node.pipeline.replica.applied == alone.replica.applied or kept is None
        assert node.pipeline.equivocation.is_equivocated(UID) == (kept is None)
        assert node.held() == nodes[0].held() or kept is None
        torch.testing.assert_close(node.pipeline.replica.params, nodes[0].pipeline.replica.params)
        if kept is not None:
            torch.testing.assert_close(node.pipeline.replica.params, alone.replica.params)


def test_two_halves_that_applied_their_own_variant_meet_and_void_it() -> None:
    """The session 25 failure: two replicas each applied their own half's variant. Without
    a named variant neither fetches the other (they stay two points); with it both form the
    proof and end on one point."""
    left, right = _Node(PAIRS["tie"]), _Node(PAIRS["tie"])
    left.gossip_brings(LEFT)
    right.gossip_brings(RIGHT)
    assert not torch.equal(left.pipeline.replica.params, right.pipeline.replica.params)
    assert left.book.decide(RID, left.held(), None) == "unnamed"  # an old notice: nothing
    left.notice(RIGHT)
    right.notice(LEFT)
    assert left.proofs and right.proofs and left.proofs[0] == right.proofs[0]
    torch.testing.assert_close(left.pipeline.replica.params, right.pipeline.replica.params)
    assert left.pipeline.replica.applied_digest() == right.pipeline.replica.applied_digest()


# ---- the exchange: a notice naming another variant fetches it once, and the proof forms ------


class _Info:
    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id


class _Outsider:
    """A real GroupExchange (no network: the notifier's `update` stream is the bytes it
    serves) in front of a real merge that applied LEFT, as node.network_swarm wires it."""

    def __init__(self, served: GroupUpdate) -> None:
        self.pipeline = _pipeline()
        assert _apply(self.pipeline, LEFT)
        self.fetches: list[tuple[str, str, int, str]] = []
        self.rejected: list[str] = []
        self.proofs: list[GroupProof] = []
        network = SimpleNamespace(identity=Identity.generate(), config=SimpleNamespace(run_id=RUN))
        self.node = GroupExchange(
            network,  # type: ignore[arg-type]
            numel=NUMEL,
            reject=lambda reason, peer, detail: self.rejected.append(reason),
            is_alive=lambda _: True,
            offer=lambda key, seq, holder: None,
            fetch=self._fetch,
            on_update=self._on_update,
            applied_seq=self.pipeline.replica.last_seq,
        )
        self.node.applied_variant = self._applied_variant
        self.served = encode_update(served)

    def _applied_variant(self, group_key: str, seq: int) -> str | None:
        key = self.pipeline.groups.variants.key_of((group_key, seq))
        return None if key is None else variant_digest(key)

    async def _fetch(self, peer: str, key: str, seq: int, cause: str = "adopt") -> bytes:
        self.fetches.append((peer, key, seq, cause))
        return self.served

    def _on_update(self, update: GroupUpdate) -> bool:
        result = self.pipeline.submit_group(update, member_check(RUN, update.head.group_key))
        if result.reason == "group_equivocation":
            proof = self.pipeline.group_evidence(update)
            assert proof is not None
            self.proofs.append(proof)
        return result.accepted

    def hear(self, notice: SignedDone, variant: str | None) -> None:
        done = replace(notice.done, variant=variant)
        blob = replace(notice, done=done).to_bytes()

        async def receive(reader: object, **_: object) -> bytes:
            return blob

        async def deliver() -> None:
            original, ge.receive_blob = ge.receive_blob, receive  # type: ignore[assignment]
            try:
                await self.node.rpc_done(_Info(notice.signer), None, None)
                while self.node._tasks:
                    await asyncio.gather(*list(self.node._tasks))
            finally:
                ge.receive_blob = original

        asyncio.run(deliver())


def test_a_replica_that_applied_one_variant_fetches_the_named_other_once_and_proves_it() -> None:
    outsider = _Outsider(served=RIGHT)
    notifier = IDS[1]  # in RIGHT's included set
    notice = SignedDone.of(Done.of(RIGHT), notifier, RUN)
    outsider.hear(notice, variant=None)  # a session 25 notice: the id is applied, nothing
    outsider.hear(notice, variant=_digest(LEFT))  # the variant applied here: nothing
    assert outsider.fetches == [] and outsider.proofs == []
    outsider.hear(notice, variant=_digest(RIGHT))
    assert outsider.fetches == [(notifier.peer_id, UID[0], UID[1], "variant")]
    assert len(outsider.proofs) == 1 and outsider.proofs[0].update_id == UID
    outsider.hear(notice, variant=_digest(RIGHT))  # told again: not fetched again
    assert len(outsider.fetches) == 1 and outsider.rejected == []


def test_a_notice_naming_a_variant_its_sender_does_not_serve_costs_one_fetch_counted() -> None:
    outsider = _Outsider(served=RIGHT)
    notice = SignedDone.of(Done.of(RIGHT), IDS[1], RUN)
    made_up = [f"{n:016x}" for n in range(4)]
    for variant in made_up:
        outsider.hear(notice, variant=variant)
    assert len(outsider.fetches) == MAX_VARIANTS_FETCHED  # then the round's fetches are spent
    assert outsider.rejected == ["group_done_wrong_variant"] * MAX_VARIANTS_FETCHED + [
        "group_done_variants_capped"
    ] * (len(made_up) - MAX_VARIANTS_FETCHED)
    assert outsider.proofs == []  # nothing served was merged
