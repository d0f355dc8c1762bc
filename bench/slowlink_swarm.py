"""bench.slowlink's swarm: its settings (:class:`SlowlinkConfig`) and one row's nodes, each in
its network namespace (:class:`Swarm`: started, waited on with bounded waits, reaped by
`stop()` whatever happens). Moved out of bench/slowlink.py unchanged (session 24), which
re-exports SlowlinkConfig.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pydantic.dataclasses

from bench import netns
from bench.procs import ChildProcess, Event, cli_flags, python_module, reap_all
from merge.codecs import CODECS
from node.settings import FLAGS

START_TIMEOUT_S = 240.0
"""Bounded wait for a node to start training (3 nodes start slowly on a loaded 2-core box)."""
STOP_TIMEOUT_S = 20.0
"""How long the nodes get to stop cleanly after a row before their groups are killed."""
BOOTSTRAP_PORT = 31337
"""TCP port of the bootstrap peer on the bridge."""
POLL_S = 0.5
"""How often a row checks whether every node has reached the target."""


@pydantic.dataclasses.dataclass(kw_only=True, config=FLAGS)
class SlowlinkConfig:
    """A slow-link comparison: the swarm, the link, the codecs and the target."""

    nodes: int = 3
    """Nodes, one network namespace each."""
    link_mbit: float = 2.0
    """Rate of every node's link, each way, in Mbit/s (tc tbf)."""
    codecs: str = "bf16,int8,int4,sparse"
    """Codecs to compare, comma-separated; bf16 is the baseline of the ratios."""
    fragments: str = "1,4"
    """Fragment counts P, comma-separated (1: whole updates); P > 1 rows run only when
    `join --fragments` exists in this build."""
    model: str = "tiny"
    """Model preset of every node."""
    inner_steps: int = 10
    """H: inner steps per round."""
    step_s: float = 0.8
    """Every inner step is paced to last this long (--emulated-step-s), so compute is equal
    in every row whatever the machine's load; must exceed a step's real duration."""
    target_loss: float = 2.8
    """Validation loss every node's replica must reach."""
    budget_s: float = 240.0
    """A row that has not reached the target this long after the links were limited stops
    (reported as not reached)."""
    eval_batches: int = 4
    """Validation batches each node evaluates after every round."""
    heartbeat_period: float = 2.0
    """Heartbeat period of the nodes."""
    probe_bytes: int = 500_000
    """Bytes of the TCP transfer that checks the limit (0 skips the check)."""
    seed: int = 0
    """Genesis seed of every row."""
    reference: bool = True
    """First run bf16 on unlimited links: what the limit costs bf16 (the reference row)."""
    keep_logs: bool = True
    """Write every node's events under bench/results/slowlink/RATEmbit-CODEC-pP/."""

    def __post_init__(self) -> None:
        if self.nodes < 2:
            raise ValueError("--nodes must be at least 2")
        for name in ("link_mbit", "step_s", "target_loss", "budget_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if not self.codec_list or not self.fragment_list:
            raise ValueError("--codecs and --fragments must each name at least one value")
        if any(p < 1 for p in self.fragment_list):
            raise ValueError("--fragments takes counts of at least 1")
        unknown = set(self.codec_list) - set(CODECS)
        if unknown:
            raise ValueError(f"unknown codec {', '.join(sorted(unknown))}; use {', '.join(CODECS)}")

    @property
    def codec_list(self) -> list[str]:
        return [c for c in self.codecs.split(",") if c]

    @property
    def fragment_list(self) -> list[int]:
        try:
            return [int(p) for p in self.fragments.split(",") if p]
        except ValueError:
            raise ValueError(f"--fragments takes counts such as 1,4: {self.fragments!r}") from None


def join_supports(flag: str) -> bool:
    """Whether this build's `python -m node join` has `flag` (read from its --help)."""
    result = subprocess.run(
        python_module("node", "join", "--help"), capture_output=True, text=True, timeout=120
    )
    return flag in result.stdout


class Swarm:
    """One row's nodes, each in its namespace of `lab`; reaped by `stop()` whatever happens."""

    def __init__(self, config: SlowlinkConfig, lab: netns.NetnsLab, home: Path, extra: list[str]):
        self.config = config
        self.lab = lab
        self.home = home
        self.extra = extra
        self.run_id = f"slowlink-{int(time.time())}"
        self.children: list[ChildProcess] = []
        """The bootstrap peer, then the nodes."""
        self.t0 = 0.0
        """When the links were limited and the clock started."""

    @property
    def nodes(self) -> list[ChildProcess]:
        return [c for c in self.children if c.name.startswith("node")]

    def command(self, node: int, peers: list[str]) -> list[str]:
        c = self.config
        flags = cli_flags(
            run_id=self.run_id,
            model=c.model,
            seed=c.seed,
            inner_steps=c.inner_steps,
            emulated_step_s=c.step_s,
            eval_batches=c.eval_batches,
            heartbeat_period=c.heartbeat_period,
            checkpoint_every=1000,
            threads=1,
            log_format="json",
            host=self.lab.address(node),
            port=0,
        )
        flags += ["--peers", *peers] if peers else []
        return python_module("node", "join", *flags, *self.extra)

    def launch(self, node: int, peers: list[str]) -> ChildProcess:
        child = ChildProcess(
            f"node{node}",
            self.command(node, peers),
            home=self.home / f"node{node}",
            prefix=self.lab.exec_prefix(node),
        )
        self.children.append(child)
        return child.start()

    def start(self) -> None:
        """A bootstrap peer on the bridge, then every node at once, joining through it; returns
        when every node trains. (Started one after another through node 0, node 0 would train
        alone for the others' start-up time, a head start that differs from row to row.)"""
        bootstrap = self.start_bootstrap()
        for node in range(self.config.nodes):
            self.launch(node, [bootstrap])
        for child in self.nodes:
            child.wait_event("started", START_TIMEOUT_S)

    def start_bootstrap(self) -> str:
        """hivemind's own DHT peer (`hivemind-dht`) in the hub namespace; its multiaddr."""
        host = self.lab.bridge_address()
        argv = python_module("hivemind.hivemind_cli.run_dht", "--no_relay", "--host_maddrs")
        child = ChildProcess(
            "bootstrap",
            [*argv, f"/ip4/{host}/tcp/{BOOTSTRAP_PORT}"],
            home=self.home / "bootstrap",
            prefix=self.lab.hub_prefix(),
        )
        self.children.append(child)
        child.start()
        pattern = re.compile(rf"/ip4/{re.escape(host)}/tcp/{BOOTSTRAP_PORT}/p2p/\w+")
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and child.alive():
            found = [m.group(0) for line in list(child.stderr) if (m := pattern.search(line))]
            if found:
                return found[0]
            time.sleep(0.2)
        raise RuntimeError(f"the bootstrap peer did not start\n{child.stderr_tail()}")

    def stop(self) -> list[str]:
        for child in self.children:
            child.interrupt()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in self.children:
            child.finish(max(0.1, deadline - time.monotonic()))
        return reap_all(self.children)

    def reached_at(self, node: int) -> Event | None:
        """The first round_done of `node` since t0 whose val_loss is at or below the target."""
        for event in self.nodes[node].of("round_done"):
            loss = event.get("val_loss")
            if event["time"] >= self.t0 and loss is not None and loss <= self.config.target_loss:
                return event
        return None

    def wait_target(self) -> None:
        """Until every node has reached the target or the budget is spent."""
        self.t0 = time.time()
        while time.time() - self.t0 < self.config.budget_s:
            if all(self.reached_at(n) for n in range(self.config.nodes)):
                return
            for child in self.children:
                if not child.alive():
                    raise RuntimeError(f"{child.name} exited during the run\n{child.stderr_tail()}")
            time.sleep(POLL_S)
