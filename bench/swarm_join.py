"""A newcomer joins a loopback swarm: join latency, state download and update fetch rates,
and the memory that the state transfer costs the donor and the newcomer.

    python -m bench.swarm_join                    # small model, 3 nodes + 1 newcomer
    python -m bench.swarm_join --model tiny       # quicker
    python -m bench.swarm_join --model base --nodes 1 --batch-size 1 --inner-steps 1 \
        --warmup-rounds 1                          # the state transfer of a `base` replica

Each transfer rate is printed beside hivemind's raw binary stream between two p2pd daemons
measured in the same run on the same machine (ratio). Peak RSS of the donor's and the
newcomer's main process during the transfer, above what each held just before it, is
printed as a multiple of the replica's size. The final line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from hivemind.p2p import P2P

from bench.procs import ChildProcess, python_module
from bench.sampling import BackgroundSampler, rss_bytes

RAW_MB = 100
CHUNK = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=("tiny", "small", "base"))
    parser.add_argument("--inner-steps", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=3, help="nodes before the newcomer")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per inner step")
    parser.add_argument("--warmup-rounds", type=int, default=2, help="rounds before the newcomer")
    parser.add_argument("--timeout", type=float, default=900, help="bound on every wait, seconds")
    args = parser.parse_args()
    raw_before = asyncio.run(raw_stream_mb_per_s())
    swarm = measure_swarm(args)
    raw_after = asyncio.run(raw_stream_mb_per_s())
    raw = statistics.mean([raw_before, raw_after])
    figures = {
        "benchmark": "swarm_join",
        "model": args.model,
        **swarm,
        "raw_stream_mb_per_s": round(raw, 1),
        "state_download_ratio_to_raw": round(swarm["state_download_mb_per_s"] / raw, 3),
    }
    if swarm["update_fetch_mb_per_s"] is not None:
        figures["update_fetch_ratio_to_raw"] = round(swarm["update_fetch_mb_per_s"] / raw, 3)
    for key, value in figures.items():
        print(f"{key:>36}: {value}")
    print(json.dumps(figures))


def measure_swarm(args: argparse.Namespace) -> dict[str, Any]:
    run = ["--model", args.model, "--inner-steps", str(args.inner_steps), "--threads", "1",
           "--eval-batches", "1", "--heartbeat-period", "2"]  # fmt: skip
    if args.batch_size:
        run += ["--batch-size", str(args.batch_size)]
    nodes: list[ChildProcess] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            return _run_swarm(Path(tmp), run, nodes, args)
        finally:
            for node in nodes:
                node.reap()


def _run_swarm(
    tmp: Path, run: list[str], nodes: list[ChildProcess], args: argparse.Namespace
) -> dict[str, Any]:
    def launch(name: str, *extra: str) -> ChildProcess:
        argv = python_module("node", "join", "--log-format", "json", "--host", "127.0.0.1",
                             "--port", "0", *run, *extra)  # fmt: skip
        node = ChildProcess(name, argv, home=tmp / name).start()
        nodes.append(node)
        return node

    first = launch("node0")
    maddr = first.wait_event("listening", args.timeout)["maddrs"][0]
    others = [launch(f"node{i}", "--peers", maddr) for i in range(1, args.nodes)]
    for node in [first, *others]:
        node.wait_for(
            lambda e: e.get("event") == "round_done" and e["round"] >= args.warmup_rounds,
            args.timeout,
            "warm-up rounds",
        )
    joined_at = time.time()
    newcomer = launch("newcomer", "--peers", maddr)
    with RssSampler([first, *others, newcomer]) as rss:
        listening = newcomer.wait_event("listening", args.timeout)
        state = newcomer.wait_event("state_downloaded", args.timeout)
        time.sleep(1.0)  # the donor's side may end a moment after the newcomer's
    donor = next(n for n in [first, *others] if n.of("listening")[0]["peer_id"] == state["peer_id"])
    replica_bytes = state["megabytes"] * 1e6
    window = (listening["time"], state["time"] + 1.0)
    own = (listening["time"], state["time"])  # the newcomer starts training right after
    first_own = newcomer.wait_for(
        lambda e: e.get("event") == "update_merged" and e["author"] == listening["peer_id"],
        args.timeout,
        "the newcomer's first update",
    )
    merged_elsewhere = first.wait_for(
        lambda e: (
            e.get("event") == "update_merged"
            and e["author"] == listening["peer_id"]
            and e["seq"] == first_own["seq"]
        ),
        args.timeout,
        "the newcomer's first update merged by node0",
    )
    fetches = [e for node in [first, *others] for e in node.of("update_fetched")]
    fetch_rate = statistics.median(e["mb_per_s"] for e in fetches) if fetches else None
    return {
        "join_to_listening_s": round(listening["time"] - joined_at, 2),
        "join_to_state_s": round(state["time"] - joined_at, 2),
        "join_to_first_merged_update_s": round(merged_elsewhere["time"] - joined_at, 2),
        "state_megabytes": state["megabytes"],
        "state_download_mb_per_s": state["mb_per_s"],
        "donor_rss_over_replica": round(rss.growth(donor, window) / replica_bytes, 3),
        "newcomer_rss_over_replica": round(rss.growth(newcomer, own) / replica_bytes, 3),
        "update_megabytes": statistics.median(e["megabytes"] for e in fetches) if fetches else 0,
        "update_fetch_mb_per_s": round(fetch_rate, 2) if fetch_rate is not None else None,
        "num_fetches": len(fetches),
    }


class RssSampler(BackgroundSampler):
    """Samples the resident memory of each child's main process every 20 ms."""

    def __init__(self, children: list[ChildProcess], period_s: float = 0.02) -> None:
        super().__init__(period_s)
        self._samples: dict[str, list[tuple[float, int]]] = {c.name: [] for c in children}
        self._processes = {c.name: psutil.Process(c.pid) for c in children}

    def sample(self) -> None:
        now = time.time()
        for name, process in self._processes.items():
            rss = rss_bytes(process)
            if rss is not None:
                self._samples[name].append((now, rss))

    def growth(self, child: ChildProcess, window: tuple[float, float]) -> float:
        """Peak RSS within `window` minus the last sample before it, in bytes (rounded)."""
        samples = self._samples[child.name]
        before = [rss for t, rss in samples if t < window[0]] or [samples[0][1]]
        during = [rss for t, rss in samples if window[0] <= t <= window[1]] or before
        return float(max(0, max(during) - before[-1]))


async def raw_stream_mb_per_s() -> float:
    """hivemind's raw binary stream between two fresh p2pd daemons on loopback."""
    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = await P2P.create(initial_peers=await server.get_visible_maddrs())
    payload = bytes(RAW_MB * CHUNK)

    async def serve(_info: object, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        await P2P.send_raw_data(payload, writer, chunk_size=CHUNK)
        writer.close()

    try:
        await server.add_binary_stream_handler("raw", serve)
        started = time.perf_counter()
        _, reader, writer = await client.call_binary_stream_handler(server.peer_id, "raw")
        received = await P2P.receive_raw_data(reader)
        elapsed = time.perf_counter() - started
        writer.close()
        assert len(received) == len(payload)
        return len(received) / 1e6 / elapsed
    finally:
        await client.shutdown()
        await server.shutdown()


if __name__ == "__main__":
    main()
