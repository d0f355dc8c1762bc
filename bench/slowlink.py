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

Split in session 24 (code moved unchanged): the settings and one row's nodes are
bench.slowlink_swarm (SlowlinkConfig re-exported here), the terminal tables
bench.slowlink_report; the rows, the probe and the command stay here.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import signal
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from statistics import mean
from types import FrameType

from bench import netns
from bench.slowlink_report import format_probe, format_table
from bench.slowlink_swarm import SlowlinkConfig, Swarm, join_supports
from node.config import add_config_arguments, config_from_args

logger = logging.getLogger(__name__)

RESULTS_DIR = Path(__file__).resolve().parent / "results" / "slowlink"


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
