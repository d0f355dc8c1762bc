"""`python -m bench.chaos --topology nat`: the chaos run with its nodes behind real NATs, then the
same run on loopback, side by side.

    python -m bench.chaos --topology nat                      # 4 nodes, MTBF 120 s kill -9, 300 s
    python -m bench.chaos --topology nat --duration-s 120 --up-mbit 2
    python -m bench.chaos --topology nat --nats cone,cone,symmetric --observers 3  # can punch

Layout (bench/nat.py): node 0 trains on the public machine (it announces its address and
relays); the others sit in two homes, alternately behind the cone NAT and the symmetric one
(4 nodes: 2 behind the cone, 1 behind the symmetric), with --auto-relay and node 0 as their
bootstrap. Each home's line is asymmetric: --down-mbit in, --up-mbit out (tc tbf). Faults
are kill -9 only (a cut needs the flat bridge of bench/netns.py); a killed node restarts with
the same HOME after --downtime-s, node 0 on its fixed address, the others through it.
`--nats` names each home's NAT (the NAT'd nodes are spread over the homes in turn);
`--observers K` adds K `diloco-node bootstrap`s on public machines 1..K, never faulted, in
every home's `--peers`: with 3 of them a cone home is seen by the 4 public observers
go-libp2p wants before it serves hole punching (docs/nat.md), so two cone homes can punch.

Then the same seeded schedule runs on loopback (no namespaces). The final line is JSON:
{"goodput", "goodput_loopback", "val_loss", "val_loss_loopback", "paths": {"direct",
"holepunched", "relayed"}, ...}: goodput as bench/chaos_accounting.py counts it, val loss the
median over nodes of each node's last evaluation, and paths the update fetches of the NAT run
by the path their connection took (dht.reachability) at the time.
"""

from __future__ import annotations

import json
import logging
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.chaos import RESULTS_DIR, Fault, Phase, make_schedule, play
from bench.nat import Home, NatLab, missing
from bench.procs import ChildProcess, python_module, reap_all
from dht.reachability import PATH_KINDS

if TYPE_CHECKING:
    from bench.chaos import ChaosConfig

logger = logging.getLogger(__name__)
PUBLIC_PORT = 4100


class NatPlacement:
    """Where each node runs in the NAT bed, with the interface Phase asks of a lab: node 0 on
    public machine 0, the observers on public machines 1..K, NAT'd node i (1-based) in home
    (i - 1) mod H, one machine after the other."""

    def __init__(self, lab: NatLab, num_nodes: int) -> None:
        self.lab = lab
        self.namespaces = [lab.public(0)] + [
            lab.host(r, j) for r, j in home_slots(num_nodes, len(lab.homes))
        ]

    def exec_prefix(self, node: int) -> list[str]:
        return NatLab.prefix(self.namespaces[node])

    def address(self, node: int) -> str:
        return "0.0.0.0"

    @property
    def public_address(self) -> str:
        return public_maddr(self.lab, 0)

    def nat_of(self, node: int) -> str:
        if node == 0:
            return "public"
        home = int(self.namespaces[node].rsplit("-h", 1)[1].split("-")[0])
        return self.lab.homes[home].nat


def public_maddr(lab: NatLab, i: int) -> str:
    """Public machine i's fixed listening address (without its peer id)."""
    return f"/ip4/{lab.public_address(i)}/tcp/{PUBLIC_PORT}"


def home_slots(num_nodes: int, num_homes: int) -> list[tuple[int, int]]:
    """(home, machine) of NAT'd nodes 1..num_nodes-1: spread over the homes in turn."""
    return [((i - 1) % num_homes, (i - 1) // num_homes) for i in range(1, num_nodes)]


def homes_for(num_nodes: int, nats: list[str] | None = None) -> tuple[Home, ...]:
    """The home networks, one per NAT in `nats` (default: a cone, then a symmetric), each
    with as many machines as nodes placed in it (at least one)."""
    kinds = nats or ["cone", "symmetric"]
    counts = Counter(r for r, _ in home_slots(num_nodes, len(kinds)))
    return tuple(Home(kind, max(1, counts[r])) for r, kind in enumerate(kinds))


class NatPhase(Phase):
    """Phase with node 0 public (fixed port, announced) and the rest NAT'd with --auto-relay,
    always bootstrapping through node 0 and the observers (public bootstraps that train
    nothing, started first and never faulted)."""

    def __init__(
        self, config: ChaosConfig, home: Path, placement: NatPlacement, num_observers: int = 0
    ) -> None:
        super().__init__(config, "async", home, placement)  # type: ignore[arg-type]
        self.placement = placement
        self.num_observers = num_observers
        self.observers: list[ChildProcess] = []
        self._observer_maddrs: list[str] = []

    def command(self, node: int, peers: list[str]) -> list[str]:
        public = self.placement.public_address
        if node == 0:
            own = [*super().command(node, self._observer_maddrs)]
            return [*own, "--port", str(PUBLIC_PORT), "--announce", public]
        peers = [*self._public_maddrs(), *self._observer_maddrs]
        return [*super().command(node, peers), "--auto-relay"]

    def _public_maddrs(self) -> list[str]:
        public = self.placement.public_address
        for child in self.children[0]:
            for listening in child.of("listening"):
                found = [m for m in listening["maddrs"] if m.startswith(public + "/p2p/")]
                if found:
                    return found[:1]
        raise RuntimeError("node 0 (public) never said its address")

    def live_maddrs(self, exclude: int) -> list[str]:
        return [] if exclude == 0 else self._public_maddrs()

    def start_all(self) -> float:
        self._start_observers()
        first = self.launch(0, [])
        first.wait_event("listening", 240.0)
        for node in range(1, self.config.nodes):
            self.launch(node, [])
        for children in self.children:
            children[-1].wait_event("started", 240.0)
        return time.time()

    def _start_observers(self) -> None:
        lab = self.placement.lab
        for i in range(1, 1 + self.num_observers):
            argv = python_module("node", "bootstrap", "--port", str(PUBLIC_PORT))
            argv += ["--announce", public_maddr(lab, i)]
            home = self.home / f"observer{i}"
            child = ChildProcess(f"observer{i}", argv, home=home, prefix=lab.prefix(lab.public(i)))
            self.observers.append(child.start())
        self._observer_maddrs = [
            said_maddr(child, public_maddr(lab, i), 240.0)
            for i, child in enumerate(self.observers, start=1)
        ]

    def stop_all(self) -> list[str]:
        survivors = super().stop_all()
        for child in self.observers:
            child.interrupt()
        for child in self.observers:
            child.finish(10.0)
        return survivors + reap_all(self.observers)


def said_maddr(child: ChildProcess, address: str, timeout_s: float) -> str:
    """The full address (with peer id) a `diloco-node bootstrap` prints once it listens
    ("bootstrap and relay at MADDR ...")."""
    deadline = time.monotonic() + timeout_s
    while True:
        said = [w for line in child.stderr for w in line.split() if w.startswith(address + "/p2p/")]
        if said:
            return said[0]
        if not child.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{child.name} never said its address\n{child.stderr_tail()}")
        time.sleep(0.2)


def measure(config: ChaosConfig, schedule: list[Fault], phase: Phase, name: str) -> dict[str, Any]:
    """Run `phase` on `schedule`; its goodput figures, val loss and fetches by path."""
    figures, survivors = play(phase, schedule, RESULTS_DIR / "chaos_nat" / name, False)
    events = [e for children in phase.children for c in children for e in c.events]
    restarts = [c.events for children in phase.children for c in children[1:]]
    return figures | {
        "val_loss": final_val_loss(phase),
        "paths": fetch_paths(events),
        "state_check_s": state_check_seconds(restarts),
        "orphans_killed": len(survivors),
    }


def state_check_seconds(incarnations: list[list[dict[str, Any]]]) -> list[float]:
    """Per incarnation that got there, seconds from `listening` to the end of its state check
    (`startup_phase` state_check: the download, if any peer was ahead), ascending."""
    found = []
    for events in incarnations:
        listening = [e["time"] for e in events if e.get("event") == "listening"]
        checked = [
            e["time"]
            for e in events
            if e.get("event") == "startup_phase" and e.get("name") == "state_check"
        ]
        if listening and checked:
            found.append(round(checked[0] - listening[0], 1))
    return sorted(found)


def final_val_loss(phase: Phase) -> float | None:
    """Median over nodes of each node's last evaluation (its latest incarnation that has one)."""
    last = []
    for children in phase.children:
        found = [e["val_loss"] for c in children for e in c.of("evaluated")]
        if found:
            last.append(found[-1])
    return round(statistics.median(last), 4) if last else None


def fetch_paths(events: list[dict[str, Any]]) -> dict[str, int]:
    """Update fetches by the path of the connection they used (unknown ones left out)."""
    found = Counter(e.get("path") for e in events if e.get("event") == "update_fetched")
    return {kind: found.get(kind, 0) for kind in PATH_KINDS}


def run_nat(config: ChaosConfig) -> dict[str, Any]:
    """The NAT run and the loopback run on one seeded kill schedule."""
    why = missing()
    if why is not None:
        raise SystemExit(f"--topology nat: {why}")
    config = replace(config, kinds="kill", methods="async")
    schedule = make_schedule(config)
    with tempfile.TemporaryDirectory(prefix="chaos-nat-") as directory:
        home = Path(directory)
        homes = homes_for(config.nodes, config.nat_list)
        lab = NatLab(
            num_public=1 + config.observers,
            homes=homes,
            down_mbit=config.down_mbit,
            up_mbit=config.up_mbit,
        )
        with lab:
            placement = NatPlacement(lab, config.nodes)
            phase = NatPhase(config, home / "nat", placement, config.observers)
            nat = measure(config, schedule, phase, "nat")
            where = [placement.nat_of(n) for n in range(config.nodes)]
        loop_phase = Phase(config, "async", home / "loopback", None)
        loopback = measure(config, schedule, loop_phase, "loopback")
    return {
        "goodput": nat["goodput"],
        "goodput_loopback": loopback["goodput"],
        "val_loss": nat["val_loss"],
        "val_loss_loopback": loopback["val_loss"],
        "paths": nat["paths"],
        "placement": where,
        "observers": config.observers,
        "config": asdict(config),
        "schedule": [asdict(f) for f in schedule],
        "nat": nat,
        "loopback": loopback,
    }


def main_nat(config: ChaosConfig) -> None:
    report = run_nat(config)
    for fault in report["schedule"]:
        print(f"fault at {fault['at_s']:6.1f} s: kill node{fault['node']}")
    for name in ("nat", "loopback"):
        figures = report[name]
        print(
            f"{name:<9} goodput {figures['goodput']:.3f}  val loss {figures['val_loss']}  "
            f"restarts {figures['restarts']}  lost {figures['updates_lost']}  "
            f"state check after restart {figures['state_check_s']} s"
        )
    print(f"paths (update fetches, NAT run): {report['paths']}")
    print(json.dumps(report))
