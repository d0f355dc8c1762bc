"""A newcomer joins a 3-node loopback swarm: join latency, state download and update fetch rates.

    python -m bench.swarm_join                    # small model, 3 nodes + 1 newcomer
    python -m bench.swarm_join --model tiny       # quicker

Each transfer rate is printed beside hivemind's raw binary stream between two p2pd daemons
measured in the same run on the same machine (ratio). The final line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from hivemind.p2p import P2P

from bench.procs import ChildProcess, python_module

RAW_MB = 100
CHUNK = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=("tiny", "small", "base"))
    parser.add_argument("--inner-steps", type=int, default=5)
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
        "update_fetch_ratio_to_raw": round(swarm["update_fetch_mb_per_s"] / raw, 3),
    }
    print(json.dumps(figures))


def measure_swarm(args: argparse.Namespace) -> dict[str, float]:
    run = ["--model", args.model, "--inner-steps", str(args.inner_steps), "--threads", "1",
           "--eval-batches", "1", "--heartbeat-period", "2"]  # fmt: skip
    nodes: list[ChildProcess] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            return _run_swarm(Path(tmp), run, nodes, args)
        finally:
            for node in nodes:
                node.reap()


def _run_swarm(
    tmp: Path, run: list[str], nodes: list[ChildProcess], args: argparse.Namespace
) -> dict[str, float]:
    def launch(name: str, *extra: str) -> ChildProcess:
        argv = python_module("node", "join", "--log-format", "json", "--host", "127.0.0.1",
                             "--port", "0", *run, *extra)  # fmt: skip
        node = ChildProcess(name, argv, home=tmp / name).start()
        nodes.append(node)
        return node

    first = launch("node0")
    maddr = first.wait_event("listening", args.timeout)["maddrs"][0]
    others = [launch(f"node{i}", "--peers", maddr) for i in (1, 2)]
    for node in [first, *others]:
        node.wait_for(
            lambda e: e.get("event") == "round_done" and e["round"] >= args.warmup_rounds,
            args.timeout,
            "warm-up rounds",
        )
    joined_at = time.time()
    newcomer = launch("newcomer", "--peers", maddr)
    listening = newcomer.wait_event("listening", args.timeout)
    state = newcomer.wait_event("state_downloaded", args.timeout)
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
    return {
        "join_to_listening_s": round(listening["time"] - joined_at, 2),
        "join_to_state_s": round(state["time"] - joined_at, 2),
        "join_to_first_merged_update_s": round(merged_elsewhere["time"] - joined_at, 2),
        "state_megabytes": state["megabytes"],
        "state_download_mb_per_s": state["mb_per_s"],
        "update_megabytes": statistics.median(e["megabytes"] for e in fetches),
        "update_fetch_mb_per_s": round(statistics.median(e["mb_per_s"] for e in fetches), 2),
        "num_fetches": len(fetches),
    }


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
