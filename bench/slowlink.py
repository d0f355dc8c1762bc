"""Slow links: wall time to a target validation loss over tbf-limited links, per codec.

    python -m bench.slowlink                        # 3 tiny nodes, 2 Mbit/s links, every codec
    python -m bench.slowlink --codecs bf16,sparse --fragments 1 --link-mbit 1
    python -m bench.slowlink --model small --link-mbit 20 --step-s 2   # a faster machine

Three real nodes (`python -m node join`), each in its own network namespace, joined by veth
links to a bridge (bench/netns.py); every node's link is limited to --link-mbit each way by a
token-bucket filter (`tc qdisc ... tbf`), like a volunteer's access line. Needs root and tc.

For each codec (bf16, the baseline, against the compressed ones) and each fragment count P
(1: whole updates; P > 1 only when this build's `join` has --fragments), a fresh swarm: a
bootstrap peer (hivemind's own `hivemind-dht`) on the bridge, then every node at once; when
all of them train, the links are limited and the clock starts. Every inner step is paced to
--step-s (--emulated-step-s), so compute is the same in every row whatever the machine's
load, and only what crosses the link differs. A row ends when every node's replica has
reached --target-loss (its `round_done` val_loss) or after --budget-s. A reference row runs
bf16 on unlimited links first: what the limit costs.

Before the rows, one TCP transfer between two limited namespaces checks that tbf bites: its
measured rate is reported next to the configured one. Per row: the nodes' own byte counters
(`round_done` bytes_sent, up to the target), the bytes tbf let onto each node's link (tc's
counters: what really crossed it, headers included) and their share of the link's rate, peer
updates merged per node and how long one took from its author's own merge (publishing) to
the node's update_merged.
The final line is JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from statistics import mean
from types import FrameType

import pydantic.dataclasses

from bench import netns
from bench.procs import ChildProcess, Event, cli_flags, python_module, reap_all
from merge.codecs import CODECS
from node.config import add_config_arguments, config_from_args
from node.settings import FLAGS

logger = logging.getLogger(__name__)

RESULTS_DIR = Path(__file__).resolve().parent / "results" / "slowlink"
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


def node_figures(swarm: Swarm, node: int, t0: float) -> dict:
    """One node's figures: when it reached the target, bytes sent by then, how late peers'
    updates reached its replica."""
    child = swarm.nodes[node]
    rounds = [e for e in child.of("round_done") if e["time"] >= t0]
    reached = swarm.reached_at(node)
    upto = reached or (rounds[-1] if rounds else None)
    delays = merge_delays(swarm, node, t0)
    fetched = [e for e in child.of("update_fetched") if e["time"] >= t0]
    last = rounds[-1] if rounds else None
    return {
        "time_to_target_s": round(reached["time"] - t0, 1) if reached else None,
        "bytes_sent": upto["bytes_sent"] if upto else 0,
        "bytes_received": upto["bytes_received"] if upto else 0,
        "rounds": len(rounds),
        "update_bytes": round(mean(e["update_bytes"] for e in rounds)) if rounds else None,
        "peer_updates_merged": len(delays),
        "merge_delay_s": round(mean(delays), 2) if delays else None,
        "fetch_s": round(mean(e["seconds"] for e in fetched), 2) if fetched else None,
        "final_val_loss": last["val_loss"] if last else None,
    }


def merge_delays(swarm: Swarm, node: int, t0: float) -> list[float]:
    """Seconds from a peer's publishing an update (its author merging it into its own replica,
    just before it goes out) to `node` merging it, for peers' updates merged after t0."""
    published = {}
    for peer in swarm.nodes:
        for event in peer.of("update_merged"):
            if event["author"] == peer.peer_id:
                published[(event["author"], event["seq"])] = event["time"]
    own = swarm.nodes[node].peer_id
    return [
        e["time"] - published[(e["author"], e["seq"])]
        for e in swarm.nodes[node].of("update_merged")
        if e["time"] >= t0 and e["author"] != own and (e["author"], e["seq"]) in published
    ]


def run_row(
    config: SlowlinkConfig, codec: str, fragments: int, home: Path, *, limited: bool = True
) -> dict:
    """One codec and fragment count on a fresh swarm over limited (or unlimited) links."""
    extra = ["--codec", codec] + (["--fragments", str(fragments)] if fragments > 1 else [])
    with netns.NetnsLab(config.nodes) as lab:
        swarm = Swarm(config, lab, home, extra)
        try:
            swarm.start()
            for node in range(config.nodes if limited else 0):
                lab.limit(node, config.link_mbit)
            swarm.wait_target()
            t0, elapsed = swarm.t0, time.time() - swarm.t0
            wire = [lab.link_bytes(node) for node in range(config.nodes)]
        finally:
            survivors = swarm.stop()
    if config.keep_logs:
        link = f"{config.link_mbit:g}mbit" if limited else "unlimited"
        write_logs(swarm, RESULTS_DIR / f"{link}-{codec}-p{fragments}")
    nodes = [node_figures(swarm, n, t0) for n in range(config.nodes)]
    for figures, (sent, received) in zip(nodes, wire, strict=True):
        figures |= {"wire_bytes_sent": sent, "wire_bytes_received": received}
    times = [n["time_to_target_s"] for n in nodes]
    reached = all(t is not None for t in times)
    return {
        "codec": codec,
        "fragments": fragments,
        "link_mbit": config.link_mbit if limited else None,
        "ran": True,
        "reached": reached,
        "time_to_target_s": max(times) if reached else None,  # type: ignore[type-var]
        "elapsed_s": round(elapsed, 1),
        "bytes_sent_per_node": round(mean(n["bytes_sent"] for n in nodes)),
        "wire_bytes_sent_per_node": round(mean(sent for sent, _ in wire)) if limited else None,
        "link_use": _link_use(wire, elapsed, config.link_mbit) if limited else None,
        "update_bytes": nodes[0]["update_bytes"],
        "peer_updates_merged": _mean_of(nodes, "peer_updates_merged"),
        "merge_delay_s": _mean_of(nodes, "merge_delay_s"),
        "fetch_s": _mean_of(nodes, "fetch_s"),
        "final_val_loss": _mean_of(nodes, "final_val_loss"),
        "orphans_killed": len(survivors),
        "per_node": nodes,
    }


def _link_use(wire: list[tuple[int, int]], elapsed_s: float, mbit: float) -> float:
    """Share of the link's rate the nodes' sending used, on average (tc's counters)."""
    return round(mean(sent for sent, _ in wire) * 8 / elapsed_s / 1e6 / mbit, 3)


def _mean_of(nodes: list[dict], key: str) -> float | None:
    values = [n[key] for n in nodes if n[key] is not None]
    return round(mean(values), 3) if values else None


def write_logs(swarm: Swarm, directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True, exist_ok=True)
    for child in swarm.children:
        with open(directory / f"{child.name}.jsonl", "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in child.events)
        (directory / f"{child.name}.stderr").write_text("\n".join(child.stderr))


def probe_link(config: SlowlinkConfig) -> dict:
    """Measured Mbit/s of a real transfer between two limited namespaces, each way."""
    if not config.probe_bytes:
        return {}
    with netns.NetnsLab(2) as lab:
        fast = lab.measure_mbit(0, 1, 4 * config.probe_bytes)
        for node in range(2):
            lab.limit(node, config.link_mbit)
        return {
            "unlimited_mbit": round(fast, 1),
            "limited_mbit": round(lab.measure_mbit(0, 1, config.probe_bytes), 3),
            "limited_mbit_reverse": round(lab.measure_mbit(1, 0, config.probe_bytes), 3),
            "qdisc": lab.qdiscs(0),
        }


def add_ratios(rows: list[dict]) -> None:
    """Each row's time to target over the limited bf16, whole-update row's (below 1: faster)."""
    base = next(
        (r for r in rows if r["codec"] == "bf16" and r["fragments"] == 1 and r.get("link_mbit")),
        None,
    )
    base_s = base["time_to_target_s"] if base and base.get("reached") else None
    # bf16 ran out of budget: a row that reached the target did it in under t / budget of
    # bf16's time (an upper bound, "<" in the table).
    budget_s = base.get("elapsed_s") if base and not base.get("reached") else None
    for row in rows:
        t = row.get("time_to_target_s")
        row["ratio_vs_bf16"] = round(t / base_s, 3) if t is not None and base_s else None
        if t is not None and budget_s:
            row["ratio_vs_bf16_below"] = round(t / budget_s, 3)


def not_run(codec: str, fragments: int, why: str) -> dict:
    return {
        "codec": codec,
        "fragments": fragments,
        "ran": False,
        "reached": False,
        "time_to_target_s": None,
        "note": f"not run: {why}",
    }


def run_slowlink(config: SlowlinkConfig) -> dict:
    """Every row, side by side in one run, with the link check first."""
    if not netns.available() or shutil.which("tc") is None:
        raise SystemExit("bench.slowlink needs root, iproute2 and tc (network namespaces)")
    with_fragments = join_supports("--fragments")
    probe = probe_link(config)
    rows = []
    with tempfile.TemporaryDirectory(prefix="slowlink-") as tmp:
        if config.reference:
            logger.info("row: codec bf16, unlimited links (reference)")
            rows.append(run_row(config, "bf16", 1, Path(tmp) / "reference", limited=False))
        for fragments in config.fragment_list:
            for codec in config.codec_list:
                if fragments > 1 and not with_fragments:
                    rows.append(not_run(codec, fragments, "this build's join has no --fragments"))
                    continue
                logger.info("row: codec %s, %d fragment(s)", codec, fragments)
                home = Path(tmp) / f"{codec}-p{fragments}"
                rows.append(run_row(config, codec, fragments, home))
    add_ratios(rows)
    return {
        "rows": rows,
        "link_mbit": config.link_mbit,
        "target_loss": config.target_loss,
        "probe": probe,
        "config": asdict(config),
    }


COLUMNS = (
    ("codec", "<8"),
    ("P", ">3"),
    ("link", ">6"),
    ("to target s", ">12"),
    ("x bf16", ">8"),
    ("update KB", ">10"),
    ("MB sent/node", ">13"),
    ("wire MB", ">8"),
    ("link use", ">9"),
    ("merged", ">7"),
    ("delay s", ">8"),
    ("fetch s", ">8"),
    ("final val", ">10"),
)


def format_table(report: dict) -> str:
    lines = ["".join(f"{title:{align}}" for title, align in COLUMNS)]
    for r in report["rows"]:
        if not r["ran"]:
            lines.append(f"{r['codec']:<8}{r['fragments']:>3}  {r['note']}")
            continue
        cells = (
            r["codec"],
            r["fragments"],
            "none" if r["link_mbit"] is None else f"{r['link_mbit']:g}",
            f"{r['time_to_target_s']:.1f}" if r["reached"] else f">{r['elapsed_s']:.0f}",
            _ratio_cell(r),
            _fmt(_kb(r["update_bytes"]), 0),
            _fmt(_mb(r["bytes_sent_per_node"]), 2),
            _fmt(_mb(r["wire_bytes_sent_per_node"]), 2),
            _fmt(r["link_use"], 2),
            _fmt(r["peer_updates_merged"], 1),
            _fmt(r["merge_delay_s"], 1),
            _fmt(r["fetch_s"], 1),
            _fmt(r["final_val_loss"], 3),
        )
        lines.append("".join(f"{c:{align}}" for c, (_, align) in zip(cells, COLUMNS, strict=True)))
    return "\n".join(lines)


def _ratio_cell(row: dict) -> str:
    below = row.get("ratio_vs_bf16_below")
    if row["ratio_vs_bf16"] is None and below:
        return f"<{below:.2f}"
    return _fmt(row["ratio_vs_bf16"], 2)


def _kb(num_bytes: int | None) -> float | None:
    return num_bytes / 1e3 if num_bytes is not None else None


def _mb(num_bytes: int | None) -> float | None:
    return num_bytes / 1e6 if num_bytes is not None else None


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_probe(report: dict) -> str:
    probe = report["probe"]
    if not probe:
        return "link check skipped (--probe-bytes 0)"
    return (
        f"link {report['link_mbit']} Mbit/s (tbf): a TCP transfer measured "
        f"{probe['limited_mbit']:.2f} Mbit/s ({probe['limited_mbit_reverse']:.2f} the other way), "
        f"{probe['unlimited_mbit']:.0f} Mbit/s unlimited"
    )


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_arguments(parser, SlowlinkConfig)
    config = config_from_args(SlowlinkConfig, parser.parse_args())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _raise_interrupt)  # unwinds: nodes reaped, namespaces deleted
    report = run_slowlink(config)
    print(format_probe(report))
    print(f"target validation loss {report['target_loss']}")
    print(format_table(report))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
