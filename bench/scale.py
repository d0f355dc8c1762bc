"""N nodes on loopback with one crash a minute: do live replicas agree, what does a node pay?

    python -m bench.scale                            # N = 2, 4, 8; tiny; ~8 minutes on 2 cores
    python -m bench.scale --sizes 2 4 8 16 --train-s 300    # longer
    python -m bench.scale --sim --nodes 8,64,1000            # learner groups, simulated

--sim runs bench.scale_sim instead (no processes): learner groups on a virtual clock and
network, see that module and docs/scale.md.

For each N: all nodes train `tiny` with a small H for --train-s seconds while one node a
minute is killed with SIGKILL (its whole process group) and restarted at once with the same
identity and checkpoints. Then every node stops publishing and lingers. Measured, from the
nodes' signed heartbeats (read through a DHT observer every second) and their JSON events:

- agree_share: share of samples in which every live node reported the same applied digest
  (while training, updates in flight count as disagreement);
- converge_s: after the last node stopped training, how long until all live replicas hold
  one applied set;
- max_drift: the largest relative distance between two replicas with equal applied sets
  (median_drift: its median over all rounds; final_drift: between the last heartbeats);
- settled_drift, settle_s: the same once the replicas had until --linger-s + 15 s after the
  last end of training to realign (dht.realign's settle), and when it reached 0.0;
- rss_mb: resident memory of each node's main process (mean of per-node peaks, and max);
- mb_received_per_round: update and state payload megabytes one node fetched per round it
  trained, realignments' states included since session 22 (DHT records and heartbeats
  excluded), and the same divided by N - 1;
- lost: updates declared lost (no live holder), summed over the last heartbeats; need_state:
  those waiting for a state to bring them instead (no live holder, applied by a live
  state-serving peer), likewise, and need_state_events: every `update_needs_state` of the run;
- sized_differently: update ids the nodes' last processes merged with different weights
  (learner counts) or robust verdicts: what drift with one applied set is made of;
- exit_*, converged_at_exit: the replicas as the nodes left them, from each node's own last
  event (`stopped`: applied digest, count, sketch), after every node exited: the judgement
  that does not depend on the DHT observer (at N = 16 it read 4-9 samples in 6 minutes).

The nodes' heartbeat period is 1 s up to 4 nodes and N / 4 s above (`heartbeat_period`),
their gap wait 10 periods and the convergence bound --linger-s periods: all N share this
machine's cores, and at 1 s 16 nodes missed their own liveness window.

The figures for `base` at 100 and 1000 nodes are extrapolated from the measured per-update
payload: under gossip of full updates each node receives every other node's update once per
round, so a node's bytes per round grow as (N - 1) x the update size. The final line is JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.procs import ChildProcess, node_process, reap_all, save_events
from bench.sampling import BackgroundSampler, rss_bytes
from bench.scale_keys import balanced_identities
from dht.observer import SwarmObserver
from merge.sketch import relative_distance

RUN_ID = "bench-scale"
SETTLED_DRIFT = 1e-6
"""Final drift at or under which the replicas hold one point (float rounding)."""
SETTLE_MARGIN_S = 15.0
EXIT_MARGIN_S = 60.0
"""How long after --linger-s the settle is waited for (the nodes linger 30 s more)."""


@dataclass
class Slot:
    """One node's place in the swarm: its HOME survives restarts, its processes do not."""

    name: str
    home: Path
    children: list[ChildProcess] = field(default_factory=list)
    identity: Path | None = None
    """Its identity file (`--balanced`); None: the node makes its own in HOME."""

    @property
    def current(self) -> ChildProcess:
        return self.children[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--train-s", type=float, default=80.0, help="training time per N")
    parser.add_argument("--kill-every", type=float, default=60.0, help="seconds between crashes")
    parser.add_argument("--linger-s", type=float, default=40.0, help="bound on convergence")
    parser.add_argument("--inner-steps", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300.0, help="bound on start-up waits")
    parser.add_argument(
        "--startup-s", type=float, help="time allowed for starting every node (default 20 s x N)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--events-dir", type=Path, help="keep every process's JSON events here (nN/, a file each)"
    )
    parser.add_argument(
        "--group-size", type=int, default=0, help="learner groups (join --group-size; 0: off)"
    )
    parser.add_argument("--sim", action="store_true", help="simulate learner groups instead")
    parser.add_argument("--nodes", default="8,64,1000", help="--sim: comma-separated swarm sizes")
    parser.add_argument(
        "--wired",
        action="store_true",
        help="--sim: count bytes as real nodes move them now (whole parts, whole fetches)",
    )
    parser.add_argument(
        "--scatter",
        action="store_true",
        help="with --group-size: join --group-scatter (reduce-scatter inside a group); "
        "--sim: count merge.group_shards' reduce-scatter message by message (with --wired: "
        "other groups' updates fetched whole, as real nodes do; without: by shards)",
    )
    parser.add_argument(
        "--balanced",
        action="store_true",
        help="with --group-size: identities that give every group N / G members "
        "(bench.scale_keys), so that rows of one command are like for like",
    )
    parser.add_argument(
        "--shard-fetch",
        action="store_true",
        help="with --group-size and --scatter: join --group-shard-fetch (each member fetches "
        "its slice of other groups' updates; docs/scale.md, Session 17)",
    )
    args = parser.parse_args()
    if args.shard_fetch and not (args.group_size and args.scatter):
        parser.error("--shard-fetch needs --group-size and --scatter")
    if args.sim:
        _simulate(parser, args)
        return
    results = [measure(n, args) for n in args.sizes]
    summary = {
        "benchmark": "scale",
        "model": "tiny",
        "inner_steps": args.inner_steps,
        "group_size": args.group_size,
        "group_scatter": bool(args.group_size and args.scatter),
        "group_shard_fetch": bool(args.group_size and args.scatter and args.shard_fetch),
        "balanced": bool(args.group_size and args.balanced),
        "sizes": results,
        "extrapolated_base": extrapolate(results),
    }
    print(json.dumps(summary))


def _simulate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from bench.scale_sim import SimConfig, parse_sizes, run

    try:
        sizes = parse_sizes(args.nodes)
    except ValueError as e:
        parser.error(str(e))
    result = run(sizes, SimConfig(seed=args.seed, wired=args.wired, scatter=args.scatter))
    for row in result["rows"]:
        all_to_all = row["all_to_all_mb_per_node_per_round"]
        print(
            f"N={row['nodes']}: learners={row['learners']}, MB/node/round="
            f"{row['mb_per_node_per_round']} (all-to-all {all_to_all})",
            flush=True,
        )
    print(json.dumps(result))


def measure(n: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        slots = [Slot(f"node{i}", Path(tmp) / f"node{i}") for i in range(n)]
        if args.group_size and args.balanced:
            _give_balanced_identities(slots, args.group_size, Path(tmp) / "keys")
        try:
            result = _measure(slots, args)
        finally:
            reap_all([c for slot in slots for c in slot.children])
            if args.events_dir is not None:  # a restarted node's second process: NAME-1
                save_events([c for slot in slots for c in slot.children], args.events_dir / f"n{n}")
    print(f"N={n}: " + ", ".join(f"{k}={v}" for k, v in result.items()), flush=True)
    return result


def _give_balanced_identities(slots: list[Slot], group_size: int, folder: Path) -> None:
    """Identity files that spread `slots` evenly over their groups (bench.scale_keys)."""
    folder.mkdir(parents=True)
    for slot, identity in zip(
        slots, balanced_identities(RUN_ID, len(slots), group_size), strict=True
    ):
        slot.identity = folder / f"{slot.name}.key"
        identity.save(slot.identity)


def _measure(slots: list[Slot], args: argparse.Namespace) -> dict[str, Any]:
    period = heartbeat_period(len(slots))
    linger_s = args.linger_s * period
    run = ["--model", "tiny", "--run-id", RUN_ID, "--threads", "1", "--inner-steps",
           str(args.inner_steps), "--eval-batches", "0", "--heartbeat-period", f"{period:g}",
           "--gap-wait", f"{10 * period:g}", "--linger", f"{linger_s + 30:g}"]  # fmt: skip
    if args.group_size:  # the group's parts and other groups' updates count as received
        run += ["--group-size", str(args.group_size), "--group-wait", "10"]
        run += ["--group-scatter"] if args.scatter else []
        run += ["--group-shard-fetch"] if args.scatter and args.shard_fetch else []
    # One end of training for every process, fixed before the first starts: a node's
    # --max-time counts from its own start, and 16 nodes starting on 2 cores take minutes,
    # during which the first ones (the bootstrap among them) must not stop and exit.
    startup_s = args.startup_s if args.startup_s is not None else 20.0 * len(slots)
    train_until = time.time() + startup_s + args.train_s

    def start(slot: Slot, peers: list[str]) -> ChildProcess:
        remaining = max(1.0, train_until - time.time())
        extra = ["--max-time", f"{remaining:.0f}", *(["--peers", *peers[:3]] if peers else [])]
        extra += ["--identity", str(slot.identity)] if slot.identity is not None else []
        child = node_process(slot.name, *run, *extra, home=slot.home).start()
        slot.children.append(child)
        return child

    def live_peers(slot: Slot) -> list[str]:
        """Three shuffled live members other than `slot` (the bootstrap may be the busy one)."""
        peers = [
            s.current.maddrs[0]
            for s in slots
            if s is not slot and s.current.alive() and s.current.of("listening")
        ]
        random.Random(len(slot.children)).shuffle(peers)
        return peers or bootstrap

    def last_stop() -> float | None:
        """When the last live node stopped training (it lingers, or it stopped); None while
        one still trains. A lingering node says `stopped` only when it exits, after its
        linger: by then its heartbeats are gone."""
        stops = []
        for slot in slots:
            if slot.current.alive():
                stopped = slot.current.of("lingering") or slot.current.of("stopped")
                if not stopped:
                    return None
                stops.append(float(stopped[-1]["time"]))
        return max(stops, default=None)

    bootstrap = start(slots[0], []).wait_listening(args.timeout)
    for slot in slots[1:]:
        start(slot, bootstrap)
    for slot in slots:
        _wait_started(slot, lambda s=slot: start(s, live_peers(s)), args.timeout)
    left_s = train_until - time.time()
    print(f"N={len(slots)}: every node started; {left_s:.0f} s of training left", flush=True)
    sampler = Sampler(slots, live_peers(slots[0]) + bootstrap, period)  # node0 may have stopped
    with sampler:
        kills = _crash_loop(slots, args, train_until, start, live_peers)
        converge_s = sampler.wait_converged(train_until, linger_s, last_stop, args.timeout)
        if converge_s is not None:
            sampler.wait_settled(last_stop, linger_s + SETTLE_MARGIN_S)
    _wait_exits(slots, linger_s + 30 + EXIT_MARGIN_S)  # for their `stopped` (exit_figures)
    return {**_figures(slots, sampler, kills, converge_s), "heartbeat_period_s": period}


def heartbeat_period(n: int) -> float:
    """The nodes' heartbeat period: 1 s up to 4 nodes, then 1 s per 4. All N nodes share this
    machine's cores; at 1 s, 16 nodes on 2 cores (load ~60) missed their own heartbeats'
    three-period liveness window, peers flapped dead and alive, and catch-up declared ~800
    updates lost (no live holder). A node's own default is 5 s."""
    return max(1.0, n / 4)


def _wait_exits(slots: list[Slot], bound_s: float) -> None:
    """Until every node's last process has exited (it lingers, saves and says `stopped`)."""
    deadline = time.time() + bound_s
    while time.time() < deadline and any(slot.current.alive() for slot in slots):
        time.sleep(0.5)


def _crash_loop(slots, args, train_until, start, live_peers) -> int:  # type: ignore[no-untyped-def]
    rng = random.Random(args.seed)
    kills = 0
    next_kill = time.time() + args.kill_every
    while time.time() < train_until:
        time.sleep(0.5)
        if time.time() >= next_kill and time.time() < train_until - 5:
            victim = rng.choice(slots)
            victim.current.crash()
            kills += 1
            # Several live members, not one: the first may be busy or mid-restart itself.
            peers = live_peers(victim)
            start(victim, peers)
            _wait_started(victim, lambda v=victim, p=peers: start(v, p), args.timeout)
            next_kill = time.time() + args.kill_every
    return kills


def _wait_started(slot: Slot, restart: Any, timeout_s: float, attempts: int = 3) -> None:
    """Wait for the node's `started`; a node that exits first (a DHT bootstrap that timed out
    on an overloaded machine) is started again, up to `attempts` times in all."""
    for attempt in range(attempts):
        try:
            slot.current.wait_event("started", timeout_s)
            return
        except TimeoutError:
            if slot.current.alive() or attempt == attempts - 1:
                raise
            print(f"{slot.name} exited before it started; starting it again", flush=True)
            restart()


class Sampler(BackgroundSampler):
    """Every second: each node's last heartbeat (through a DHT observer) and main-process RSS."""

    def __init__(self, slots: list[Slot], peers: list[str], heartbeat_period_s: float) -> None:
        super().__init__(period_s=1.0)
        self._slots = slots
        self._fresh_s = 3 * heartbeat_period_s
        self._observer = SwarmObserver(peers)
        self.samples: list[tuple[float, list[Any]]] = []
        self.converged_beats: list[Any] | None = None
        """The heartbeats that showed every live replica with one applied set."""
        self.settled_beats: list[Any] | None = None
        """The last heartbeats of every live replica at one applied set after that (the
        replicas then had a while to realign: dht.realign's settle)."""
        self.settle_s: float | None = None
        """Seconds from the last end of training until those showed drift 0.0 (<= 1e-6)."""
        self.rss: dict[str, int] = {}

    def close(self) -> None:
        self._observer.close()

    def sample(self) -> None:
        try:
            runs = self._observer.snapshot(RUN_ID)
        except Exception:  # a slow DHT: skip this sample
            return
        fresh = [p.heartbeat for r in runs for p in r.peers if p.last_seen_s < self._fresh_s]
        self.samples.append((time.time(), fresh))
        for slot in self._slots:
            rss = rss_bytes(slot.current.pid) if slot.current.alive() else None
            if rss is not None:
                self.rss[slot.name] = max(self.rss.get(slot.name, 0), rss)

    def wait_converged(
        self, train_until: float, bound_s: float, last_stop: Any, cap_s: float
    ) -> float | None:
        """Seconds from the last live node's end of training (its `stopped`) until every live
        node reports one applied set; None after `bound_s` more, or once `cap_s` past
        `train_until` with a node still training. A node's --max-time counts from its own
        start of training, which on a loaded machine comes minutes after its launch."""
        while time.time() < train_until + cap_s + bound_s:
            time.sleep(0.5)
            stopped = last_stop()
            if stopped is None or not self.samples:
                continue
            if time.time() > stopped + bound_s:
                return None
            at, beats = self.samples[-1]
            settled = at > stopped + 2 and all(h.state == "idle" for h in beats)
            if settled and len(beats) == len(self._slots) and _agree(beats):
                self.converged_beats = beats
                return round(at - stopped, 1)
        return None

    def wait_settled(self, last_stop: Any, bound_s: float) -> None:
        """After convergence: sample until the replicas at one applied set also hold one
        point (final drift <= SETTLED_DRIFT), or `bound_s` after the last end of training
        (the nodes linger --linger-s + 30 s from their own). Keeps the last such heartbeats."""
        stopped = last_stop()
        while stopped is not None and time.time() < stopped + bound_s:
            time.sleep(0.5)
            at, beats = self.samples[-1]
            if len(beats) != len(self._slots) or not _agree(beats):
                continue
            self.settled_beats = beats
            drift = _final_drift(beats)
            if drift is not None and drift <= SETTLED_DRIFT:
                self.settle_s = round(at - stopped, 1)
                return


RECEIVED_EVENTS = ("update_fetched", "state_downloaded", "realigned", "group_received")
"""Events whose `megabytes` a node received: updates, a joiner's state, a realignment's state
(counted since session 22: a settle's or a left-out member's download is bytes too) and a
group's in-group traffic."""


def _agree(beats: list[Any]) -> bool:
    return len({h.applied_digest for h in beats}) == 1


def _figures(
    slots: list[Slot], sampler: Sampler, kills: int, converge_s: float | None
) -> dict[str, Any]:
    n = len(slots)
    training = [beats for _, beats in sampler.samples if len(beats) >= 2]
    events = [e for slot in slots for child in slot.children for e in child.events]
    rounds_done = [e for e in events if e.get("event") == "round_done"]
    drifts = [e["drift"] for e in rounds_done if e.get("drift") is not None]
    per_round = []
    for slot in slots:
        slot_events = [e for child in slot.children for e in child.events]
        rounds = sum(e.get("event") == "round_done" for e in slot_events)
        received = sum(e["megabytes"] for e in slot_events if e.get("event") in RECEIVED_EVENTS)
        if rounds:
            per_round.append(received / rounds)
    fetched = [e["megabytes"] for e in events if e.get("event") == "update_fetched"]
    last_beats = sampler.converged_beats or next(
        (beats for _, beats in reversed(sampler.samples) if beats), []
    )  # the nodes have exited by the end: their last heartbeats while they lingered
    rss = [v / 1e6 for v in sampler.rss.values()]
    mb_per_round = statistics.mean(per_round) if per_round else 0.0
    return {
        "n": n,
        "kills": kills,
        "samples": len(training),
        "agree_share": round(sum(map(_agree, training)) / max(len(training), 1), 3),
        "converged": converge_s is not None,
        "converge_s": converge_s,
        "max_drift": max(drifts) if drifts else None,
        "median_drift": round(statistics.median(drifts), 5) if drifts else None,
        "final_drift": _final_drift(last_beats),
        "settled_drift": _final_drift(sampler.settled_beats or []),
        "settle_s": sampler.settle_s,
        "rss_mb_mean": round(statistics.mean(rss), 1) if rss else None,
        "rss_mb_max": round(max(rss), 1) if rss else None,
        "update_mb": round(statistics.median(fetched), 4) if fetched else None,
        "mb_received_per_round": round(mb_per_round, 3),
        "mb_received_per_round_per_peer": round(mb_per_round / max(n - 1, 1), 4),
        "lost": sum(h.num_lost for h in last_beats),
        "need_state": sum(h.num_need_state for h in last_beats),
        "need_state_events": sum(e.get("event") == "update_needs_state" for e in events),
        "final_num_applied": sorted(h.num_applied for h in last_beats),
        "final_digests": len({h.applied_digest for h in last_beats}),
        "sized_differently": sized_differently([s.current.events for s in slots]),
        "rejections": dict(sum((Counter(h.rejections) for h in last_beats), Counter())),
        "shard_rounds": dict(  # --shard-fetch: each member's fetch rounds by outcome
            Counter(e["outcome"].split(" ")[0] for e in events if e.get("event") == "shard_round")
        ),
        "applied_by_shards": sum(e["applied"] for e in events if e.get("event") == "shard_round"),
        "applied_in_order_on_fallback": sum(  # a fetch round's fallback (session 18)
            e.get("fallback_in_order", 0) for e in events if e.get("event") == "shard_round"
        ),
        "slices_reused": sum(  # kept from an earlier fetch round (session 18)
            e.get("slices_reused", 0) for e in events if e.get("event") == "shard_round"
        ),
        **exit_figures([s.current.events for s in slots]),
    }


def exit_figures(per_node: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The replicas as the nodes left them, from each node's own `stopped` event (its last
    process's): independent of the DHT observer, whose reads time out at load ~40 (16 nodes on
    2 cores). `converged_at_exit`: every node stopped on its own and all hold one applied set;
    `exit_drift`: the largest relative distance between sketches of one applied set."""
    stops = [
        next((e for e in reversed(es) if e.get("event") == "stopped"), None) for es in per_node
    ]
    final = [e for e in stops if e is not None and e.get("applied_digest")]
    digests = {e["applied_digest"] for e in final}
    return {
        "exit_reported": len(final),
        "exit_digests": len(digests),
        "exit_num_applied": sorted(e["num_applied"] for e in final),
        "exit_drift": _drift([(e["applied_digest"], e["sketch"]) for e in final]),
        "converged_at_exit": bool(final) and len(final) == len(per_node) and len(digests) == 1,
    }


def sized_differently(per_node: list[list[dict[str, Any]]]) -> dict[str, int]:
    """Update ids that the last processes of the nodes merged with different contributions
    (what drift between replicas with one applied set is made of): in all, and those whose
    learner count (merge.learners floor) or robust verdict (merge.robust) differed."""
    merged: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for events in per_node:
        for e in events:
            if e.get("event") == "update_merged":
                merged.setdefault((e["author"], e["seq"]), []).append(e)
    differ = [es for es in merged.values() if len({e["weight"] for e in es}) > 1]
    return {
        "ids_compared": sum(len(es) > 1 for es in merged.values()),
        "weight": len(differ),
        "learners": sum(len({e["learners"] for e in es}) > 1 for es in merged.values()),
        "robust": sum(len({e.get("robust") for e in es}) > 1 for es in merged.values()),
    }


def _final_drift(beats: list[Any]) -> float | None:
    """Largest relative distance between two last sketches of replicas with one applied set.

    During training drift includes the momentum tail of updates applied in different orders
    (it shrinks as later updates fold it in); this is what stays once everyone stopped.
    """
    return _drift([(h.applied_digest, h.sketch) for h in beats])


def _drift(replicas: list[tuple[str, Any]]) -> float | None:
    """Largest relative distance between two (applied digest, sketch) of one applied set."""
    distances = [
        relative_distance(list(a), list(b))
        for i, (digest_a, a) in enumerate(replicas)
        for digest_b, b in replicas[i + 1 :]
        if digest_a == digest_b and a and b
    ]
    known = [d for d in distances if d is not None]
    return round(max(known), 5) if known else None


def extrapolate(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-node megabytes per round for `base` at 100 and 1000 nodes, gossiping full updates.

    Measured: the megabytes one node received per round per other node, for tiny. Scaled by
    base's parameter count over tiny's, times N - 1.
    """
    per_peer = [r["mb_received_per_round_per_peer"] for r in results if r["n"] > 1]
    if not per_peer or not any(r["update_mb"] for r in results):
        return {}  # nothing gossiped whole (learner groups): no all-to-all to extrapolate
    ratio = _num_params("base") / _num_params("tiny")
    measured = statistics.mean(per_peer)
    tiny_update_mb = statistics.median(r["update_mb"] for r in results if r["update_mb"])
    return {
        "base_update_mb": round(tiny_update_mb * ratio, 1),
        "measured_tiny_mb_per_round_per_peer": round(measured, 4),
        "mb_per_node_per_round": {n: round(measured * ratio * (n - 1), 1) for n in (100, 1000)},
    }


def _num_params(preset: str) -> int:
    import torch

    from node.model import build_model, model_config

    with torch.device("meta"):
        model = build_model(model_config(preset), 0)
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    main()
