"""A rogue peer for the forged-update test.

It joins the swarm with valid settings, then announces an update whose header was changed
after signing, and prints its peer id. Usage: python -m tests.swarm.forger MADDR HOME RUN_ARGS...
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch

from node.cli import build_parser
from node.config import JoinConfig, dataclass_from_args
from node.events import RecordingEventLog
from node.runtime import Node
from tests.factories import sealed_update


def main() -> None:
    maddr, home, *run_args = sys.argv[1:]
    args = build_parser().parse_args(
        ["join", *run_args, "--peers", maddr, "--host", "127.0.0.1", "--port", "0",
         "--identity", f"{home}/id.key", "--checkpoint-dir", f"{home}/ckpt"]
    )  # fmt: skip
    node = Node(dataclass_from_args(JoinConfig, args), RecordingEventLog())
    node.join_swarm()
    try:
        applied = node.replica.num_applied
        honest = sealed_update(
            node.identity,
            delta=torch.full((node.num_params,), 1e-3),
            fingerprint=node.fingerprint,
            seq=node.seq + 1,
            base_applied=applied,
            published_applied=applied,
            inner_steps=node.config.inner_steps,
            tokens=node.merge_config.token_weight.reference_tokens,
            loss=1.0,
            created_at=None,
        )
        header = dataclasses.replace(honest.header, loss=0.5)  # the signature no longer matches
        node.seq = node.published_seq = honest.header.seq
        node.swarm.publish(dataclasses.replace(honest, header=header))  # type: ignore[union-attr]
        print(node.peer_id, flush=True)
        # Stay up while the victim looks: until its signed heartbeat counts the update's
        # rejection (bad_signature; a refused push alone, notify_bad_signature, is not the
        # update_rejected event the test waits for), or 8 heartbeat periods.
        deadline = time.monotonic() + 8 * node.config.heartbeat_period
        while time.monotonic() < deadline and not any(
            h.rejections.get("bad_signature", 0) > 0
            for h in node.swarm.alive_peers()  # type: ignore[union-attr]
        ):
            time.sleep(0.2)
    finally:
        node.swarm.shutdown()  # type: ignore[union-attr]


if __name__ == "__main__":
    main()
