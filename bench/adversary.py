"""A hostile participant that speaks the real protocol, built from this package's own classes.

It joins a swarm the way a node does (a node.runtime.Node with the run's settings, so its
fingerprint, signed heartbeats, DHT records and libp2p streams are the real ones; it does not
train), then runs attack classes one at a time against the honest nodes it finds, and after
each one reads what the honest nodes counted from their signed heartbeats (what
`diloco-node status` shows). One JSON event per line on stdout:

    {"event": "ready", "peer_id": ..., "honest": [...]}
    {"event": "attack", "attack": NAME, "sent": N, "rejected": {reason: n}, "by_node": {...},
     "rounds": {...}, "applied": {...}, "digests": {...}, "started_at": t0, "ended_at": t1}
    {"event": "poison_ready"}   (poisoned_state: start a newcomer now)
    {"event": "done"}

Usage: python -m bench.adversary --peers MADDR --home DIR [--attacks a,b] [--sybils N]
           [--settle S] [--duration S] [--until-round R] -- RUN_ARGS (the honest nodes' run
           flags: model, inner steps, ...)

Attack classes (ATTACKS): forged_header, wrong_shape, nan_inf, norm_1000x, against_direction,
replay, equivocation, oversized, notify_flood, sybil, bad_heartbeats, far_future,
mixed_subkeys, poisoned_state; and the patient ones of issue 20, which keep on for
--duration seconds or until every honest node reports --until-round: zero_flood,
summary_flood, sideways, sybil_learners, and sybil_vouchers (poisoned_state vouched for by
many Sybil heartbeats). Each class's docstring says what it sends.

The protocol peer (a real node's parts, hooked) is bench.adversary_peer; the patient classes
are bench.adversary_patient; the one-shot classes, sybil_vouchers and the runner are here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from bench.adversary_group import GroupAttacks
from bench.adversary_patient import PatientAttacks
from bench.adversary_peer import build_node
from dht.heartbeat import Heartbeat, sign_fields
from dht.messages import RUN_LISTING_KEY, announcement_subkey
from dht.records import owner_subkey
from merge.envelope import SignedHeader, SignedUpdate
from merge.identity import Identity
from node.events import JsonEventLog

logger = logging.getLogger("bench.adversary")
TEN_YEARS_S = 10 * 365 * 86400
FLOOD_STREAMS = 64
"""Notify streams the flood keeps open at once."""
SYBIL_BATCH = 64
"""Sybil heartbeats stored at once."""
SYBIL_VOUCHERS = 8
"""sybil_vouchers: Sybil heartbeats vouching for the poisoned state (beside the accomplice)."""
UpdateId = tuple[str, int]


class Adversary(PatientAttacks, GroupAttacks):
    """Attacks on the honest nodes of a swarm, one class (a method) at a time."""

    # ---- the attacks ---------------------------------------------------------------------------

    def forged_header(self) -> int:
        """Headers in an honest author's name signed by the attacker, and an own header changed
        after signing: on notify streams and as DHT announcements."""
        sent = 0
        honest = self.honest()
        for victim in honest:
            others = [h.peer_id for h in honest if h.peer_id != victim.peer_id]
            for ahead in (1, 2, 3):
                seq = victim.latest_seq + ahead
                mine = self.seal(self.benign(), seq=seq)
                header = dataclasses.replace(mine.header, author=victim.peer_id)
                blob = SignedHeader(header, mine.signature).to_bytes()
                sent += self.notify(others, blob)
                key = f"{self.swarm.config.prefix}/updates/{victim.peer_id}"
                # under the victim's own announcement subkey, with a junk record signature and
                # an expiration that outlives the real record
                sent += self.dht_store(key, announcement_subkey(victim.peer_id, seq), blob, 1e5)
        own = self.seal(self.benign())
        tampered = dataclasses.replace(own.header, loss=0.5)
        sent += self.notify(
            [h.peer_id for h in honest], SignedHeader(tampered, own.signature).to_bytes()
        )
        return sent

    def wrong_shape(self) -> int:
        """Valid signatures over a wrong element count, a payload of the wrong length, an
        unknown codec."""
        n = self.node.num_params
        sent = self.offer(self.seal(torch.zeros(n + 1), numel=n + 1))
        sent += self.offer(self.seal(torch.zeros(n - 1), numel=n))
        sent += self.offer(self.seal(bytes(4 * n), codec="int3"))
        return sent

    def nan_inf(self) -> int:
        sent = 0
        for bad in (float("nan"), float("inf"), -float("inf")):
            payload = self.benign()
            payload[len(payload) // 2] = bad
            sent += self.offer(self.seal(payload))
        return sent

    def norm_1000x(self) -> int:
        return self.offer(self.seal(self.direction() * 1000 * self.typical_norm()))

    def against_direction(self) -> int:
        """Near the norm bound (4x the median), pointed against the training direction."""
        sent = 0
        for _ in range(3):
            # 2.5x the median: inside the norm bound (4x) wherever the median is a little lower
            sent += self.offer(self.seal(-self.direction() * 2.5 * self.typical_norm()))
            time.sleep(0.5)
        return sent

    def replay(self) -> int:
        """Headers already merged, pushed again: an honest author's and the adversary's own."""
        sent = 0
        honest = [h.peer_id for h in self.honest()]
        for uid in self.swarm.gossip.retained.ids()[-4:]:
            data = self.swarm.gossip.retained.get(uid)
            if data is not None:
                sent += self.notify(honest, SignedUpdate.from_bytes(data).signed_header.to_bytes())
        for blobs in list(self.served.values())[-4:]:
            sent += self.notify(
                honest, SignedUpdate.from_bytes(blobs[None]).signed_header.to_bytes()
            )
        return sent

    def equivocation(self) -> int:
        """Two signed payloads under one update id, one per honest node; then each node is told
        of the payload the other one got."""
        honest = [h.peer_id for h in self.honest()]
        seq = self.next_seq()
        a = self.seal(self.benign(0.5), seq=seq)
        b = self.seal(self.benign(0.25), seq=seq)
        variants = [a, b]
        per_peer: dict[str | None, bytes] = {
            p: variants[i % 2].to_bytes() for i, p in enumerate(honest)
        }
        self.served[a.header.update_id] = {None: a.to_bytes(), **per_peer}
        sent = 0
        for i, peer in enumerate(honest):
            sent += self.notify([peer], variants[i % 2].signed_header.to_bytes())
        time.sleep(3 * self.swarm.config.heartbeat_period_s)  # both fetched and merged
        for i, peer in enumerate(honest):
            sent += self.notify([peer], variants[(i + 1) % 2].signed_header.to_bytes())
        return sent

    def oversized(self) -> int:
        """A header blob 16x the cap; payloads just over and far over the update size cap."""
        honest = [h.peer_id for h in self.honest()]
        blob = self.seal(self.benign()).signed_header.to_bytes()
        sent = self.notify(honest, blob + bytes(16 * 4096))
        n = self.node.num_params
        sent += self.offer(self.seal(bytes(4 * n + 1024)))
        sent += self.offer(self.seal(bytes(4 * n + (1 << 17))))
        return sent

    def notify_flood(self, count: int = 400) -> int:
        """Headers signed by fresh keys (none has a heartbeat), as fast as streams open."""
        honest = [h.peer_id for h in self.honest()]
        blobs = [
            self.seal(
                torch.zeros(4), identity=Identity.generate(), seq=1, numel=4
            ).signed_header.to_bytes()
            for _ in range(count)
        ]

        async def flood() -> list[object]:
            streams = asyncio.Semaphore(FLOOD_STREAMS)

            async def send(peer_id: str, blob: bytes) -> None:
                async with streams:
                    await asyncio.wait_for(self.net.send(peer_id, "notify", blob), 20.0)

            sends = [send(p, blob) for blob in blobs for p in honest]
            return await asyncio.gather(*sends, return_exceptions=True)

        return sum(not isinstance(r, BaseException) for r in self.call(flood(), 120.0))

    def sybil(self, duration_s: float = 10.0) -> int:
        """Every Sybil key keeps a valid signed heartbeat in the DHT (claiming to train, ahead
        in seq, with another applied set) for `duration_s`, refreshed as fast as it can."""
        key = f"{self.swarm.config.prefix}/peers"
        period = self.swarm.config.heartbeat_period_s
        deadline = time.monotonic() + duration_s
        sent = 0

        async def store_all(beats: list[tuple[Identity, bytes]]) -> int:
            stored = 0
            for i in range(0, len(beats), SYBIL_BATCH):  # one DHT call per record: small pipes
                stores = [
                    asyncio.wait_for(self.net.dht_store(key, owner_subkey(s.peer_id), b, 30.0), 30)
                    for s, b in beats[i : i + SYBIL_BATCH]
                ]
                results = await asyncio.gather(*stores, return_exceptions=True)
                stored += sum(not isinstance(r, BaseException) for r in results)
            return stored

        while time.monotonic() < deadline:
            beats = [
                (s, Heartbeat(peer_id=s.peer_id, state="training", latest_seq=5,
                              applied_digest="ab" * 32, sent_at=time.time(),
                              heartbeat_period_s=period).sign(s))
                for s in self.sybils[8:]
            ]  # fmt: skip
            sent += self.call(store_all(beats), 300.0)
        return sent

    def bad_heartbeats(self) -> int:
        """Mistyped heartbeats, one claiming an honest peer's id, one under a subkey that names
        no owner, and honest peers' records overwritten with a later expiration; written to
        the heartbeat shard the honest nodes read (this node's own leaf: below 32 peers every
        node's) and to the key of earlier versions, which they still read."""
        shards = self.swarm.membership.shards
        keys = (shards.key(shards.cursor.prefix), shards.legacy_key)
        return sum(self._bad_heartbeats(key) for key in keys)

    def _bad_heartbeats(self, key: str) -> int:
        honest = self.honest()
        victim = honest[0].peer_id
        mistyped: list[dict[str, object]] = [
            {"sketch": None},
            {"applied_digest": ["x"]},
            {"sent_at": "yesterday"},
            {"loss": 10**400},
            {"val_loss": 1e308},
            {"rejections": {str(i): i for i in range(1000)}},
        ]
        sent = 0
        for key_of, change in zip(self.sybils[:6], mistyped, strict=True):
            fields = dataclasses.asdict(Heartbeat(peer_id=key_of.peer_id, sent_at=time.time()))
            blob = sign_fields(fields | change, key_of)
            sent += self.dht_store(key, owner_subkey(key_of.peer_id), blob)
        claimer = self.sybils[6]
        claim = Heartbeat(peer_id=victim, sent_at=time.time() + 1000)
        blob = sign_fields(dataclasses.asdict(claim), claimer)
        sent += self.dht_store(key, owner_subkey(claimer.peer_id), blob)
        sent += self.dht_store(
            key, victim, Heartbeat(peer_id=self.sybils[7].peer_id).sign(self.sybils[7])
        )
        for h in honest:  # a later expiration, signed with junk (SybilValidator)
            junk = Heartbeat(peer_id=h.peer_id, state="idle", sent_at=time.time() + 1000)
            sent += self.dht_store(
                key, owner_subkey(h.peer_id), sign_fields(dataclasses.asdict(junk), claimer), 10**6
            )
        return sent

    def far_future(self) -> int:
        sent = self.offer(self.seal(self.benign(), seq=max(self.node.seq, 1) + 10**12))
        sent += self.offer(self.seal(self.benign(), created_at=time.time() + TEN_YEARS_S))
        return sent

    def mixed_subkeys(self) -> int:
        """Dictionary records whose subkeys mix int and str, where peers read them."""
        prefix = self.swarm.config.prefix
        victim = self.honest()[0].peer_id
        writes: list[tuple[str, str | int, object]] = [
            (f"{prefix}/updates/{victim}", "junk", b"x"),
            (f"{prefix}/updates/{self.node.peer_id}", "junk", b"x"),
            (f"{prefix}/peers", 12345, b"x"),
            (f"{prefix}/holders/{victim}", 7, True),
            (RUN_LISTING_KEY, 5, True),
            (f"diloco-run/{self.node.config.run_id}", 99, "x"),
        ]
        return sum(self.dht_store(k, s, v) for k, s, v in writes)

    def poisoned_state(self, wait_s: float = 150.0, vouchers: list[Identity] | None = None) -> int:
        """Serve a state with noised parameters while claiming the most progress; the harness
        starts a newcomer on `poison_ready`. Ends once the state was served, or once the
        newcomer holds a state from elsewhere (it asked corroborated donors first)."""
        before = {h.peer_id for h in self.honest()}
        self.poison_state()
        self.poison = True
        self.vouch(vouchers)
        time.sleep(2 * self.swarm.config.heartbeat_period_s)  # heartbeats carry the claim
        self.emit("poison_ready", peer_id=self.node.peer_id, accomplice=self.accomplice.peer_id)
        deadline = time.monotonic() + wait_s
        vouched = time.monotonic()
        while self.poisons_served == 0 and time.monotonic() < deadline:
            if any(h.peer_id not in before and h.num_applied > 0 for h in self.honest()):
                break  # the newcomer holds a state from elsewhere
            if time.monotonic() - vouched > self.swarm.config.heartbeat_period_s:
                self.vouch(vouchers)
                vouched = time.monotonic()
            time.sleep(0.5)
        time.sleep(2 * self.swarm.config.heartbeat_period_s)  # the newcomer tries the next donor
        self.poison = False
        return self.poisons_served

    def sybil_vouchers(self, wait_s: float = 150.0) -> int:
        """poisoned_state, vouched for by SYBIL_VOUCHERS Sybil heartbeats beside the
        accomplice: in an open swarm the keys outnumber the honest trained peers whose
        sketches the newcomer compares the state with."""
        vouchers = [self.accomplice, *self.sybils[:SYBIL_VOUCHERS]]
        return self.poisoned_state(wait_s, vouchers)

    # ---- one class at a time ---------------------------------------------------------------------

    def run(self, name: str, settle_s: float) -> None:
        before = self.observe()
        started = time.time()
        try:
            sent = int(getattr(self, name)())
            error = None
        except Exception as exc:  # report and carry on with the next class
            logger.exception("attack %s failed", name)
            sent, error = 0, f"{type(exc).__name__}: {exc}"
        after = self.observe_after(time.time() + settle_s, len(before))
        by_node: dict[str, dict[str, int]] = {}
        total: Counter[str] = Counter()
        for peer_id, beat in after.items():
            old = before[peer_id].rejections if peer_id in before else {}
            delta = {r: n - old.get(r, 0) for r, n in beat.rejections.items() if n > old.get(r, 0)}
            by_node[peer_id] = delta
            total.update(delta)
        self.emit(
            "attack",
            attack=name,
            sent=sent,
            error=error,
            rejected=dict(total),
            by_node=by_node,
            rounds={p: h.round for p, h in after.items()},
            rounds_before={p: h.round for p, h in before.items()},
            applied={p: h.num_applied for p, h in after.items()},
            digests={p: h.applied_digest for p, h in after.items()},
            val_loss={p: h.val_loss for p, h in after.items()},
            drift={p: h.drift for p, h in after.items()},
            started_at=round(started, 3),
            ended_at=round(time.time(), 3),
        )


ATTACKS = (
    "forged_header", "wrong_shape", "nan_inf", "norm_1000x", "against_direction", "replay",
    "equivocation", "oversized", "notify_flood", "bad_heartbeats", "far_future",
    "mixed_subkeys", "poisoned_state", "sybil",
    "zero_flood", "summary_flood", "sideways", "sybil_learners", "sybil_vouchers",
    "group_lone_variant",
)  # fmt: skip
"""Every attack class, in the order they run by default (the swarm-wide ones last)."""
PATIENT = ("zero_flood", "summary_flood", "sideways", "sybil_learners", "sybil_vouchers")
"""The classes of issue 20: updates and messages that pass every check, kept up."""
NEWCOMER_CLASSES = ("poisoned_state", "sybil_vouchers")
"""Classes that need a newcomer joining (started by the harness on `poison_ready`)."""
GROUP_CLASSES = ("group_lone_variant",)
"""Classes run against a learner-group run (bench.attack_group: --group-size 3)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", required=True)
    parser.add_argument("--home", required=True, type=Path)
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--sybils", type=int, default=1000, help="fake identities (>= 8)")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after each attack")
    parser.add_argument("--honest", type=int, default=2, help="honest nodes to wait for")
    parser.add_argument("--min-applied", type=int, default=6)
    parser.add_argument(
        "--duration", type=float, default=30.0, help="seconds a patient class keeps on at most"
    )
    parser.add_argument(
        "--until-round", type=int, help="a patient class stops once every honest node is here"
    )
    parser.add_argument(
        "--no-lone-push", action="store_true",
        help="group_lone_variant: notices only, its variant never pushed whole to the members",
    )  # fmt: skip
    parser.add_argument("run_args", nargs="*")
    args = parser.parse_args(argv)
    attacks = [a for a in args.attacks.split(",") if a]
    unknown = sorted(set(attacks) - set(ATTACKS))
    if unknown:
        parser.error(f"unknown attacks {unknown}; choose from {', '.join(ATTACKS)}")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    events = JsonEventLog()
    sybils = [Identity.generate() for _ in range(max(args.sybils, 8))]
    accomplice = Identity.generate()
    args.home.mkdir(parents=True, exist_ok=True)
    node = build_node(args.peers, args.home, args.run_args, [*sybils, accomplice])
    adversary = Adversary(
        node, events.emit, sybils, accomplice, duration_s=args.duration,
        until_round=args.until_round,
    )  # fmt: skip
    adversary.member = any(a in GROUP_CLASSES for a in attacks)
    adversary.push_members = not args.no_lone_push
    try:
        node.join_swarm()
        honest = adversary.wait_honest(args.honest, args.min_applied, 180.0)
        events.emit("ready", peer_id=node.peer_id, honest=[h.peer_id for h in honest])
        for name in attacks:
            adversary.run(name, args.settle)
        events.emit("done")
    finally:
        with contextlib.suppress(Exception):
            node.swarm.shutdown()  # type: ignore[union-attr]
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
