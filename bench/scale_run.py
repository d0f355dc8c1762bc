"""bench.scale's real processes: N nodes launched on loopback, one killed with SIGKILL and
restarted a minute, sampled every second through a DHT observer (see bench.scale)."""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.procs import ChildProcess, node_process, reap_all, save_events
from bench.sampling import BackgroundSampler, rss_bytes
from bench.scale_figures import agree, figures, final_drift
from bench.scale_keys import balanced_identities
from dht.observer import SwarmObserver

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
        run += ["--group-fold"] if args.scatter and args.shard_fetch and args.fold else []
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
    return {**figures(slots, sampler, kills, converge_s), "heartbeat_period_s": period}


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
            if settled and len(beats) == len(self._slots) and agree(beats):
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
            if len(beats) != len(self._slots) or not agree(beats):
                continue
            self.settled_beats = beats
            drift = final_drift(beats)
            if drift is not None and drift <= SETTLED_DRIFT:
                self.settle_s = round(at - stopped, 1)
                return
