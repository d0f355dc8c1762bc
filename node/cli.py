"""`diloco-node`: join a training swarm, watch it, make an identity key."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import NoReturn

from dht.addresses import parse_peer_maddr
from dht.swarm_config import SwarmError
from merge.identity import Identity
from node.allocator import Allocator, bounded_allocator
from node.config import DEFAULT_IDENTITY, JoinConfig, add_config_arguments, config_from_args
from node.dashboard_seam import StandaloneConfig, serve_dashboard
from node.events import EventLog, JsonEventLog, configure_logging
from node.interrupts import interrupts_deferred
from node.local_nodes import find_local_nodes, nodes_dir
from node.locks import ResourceLock, lock_identity
from node.run_choice import SwarmRun, choose_run, run_id_given, swarm_run
from node.settings_cli import check_command_given, flag_value
from node.signals import stop_on_signals
from node.status_args import DEFAULT_PAGE_SIZE, page_size

logger = logging.getLogger(__name__)


class UserError(Exception):
    """A problem the user can fix; printed as one line, no traceback."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def package_version() -> str:
    try:
        return version("diloco-node")
    except PackageNotFoundError:
        return "0+unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="diloco-node",
        description="Peer-to-peer asynchronous DiLoCo training on scattered hardware.",
    )
    parser.add_argument("--version", action="version", version=f"diloco-node {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    join = commands.add_parser(
        "join", help="train, and merge everyone's pseudo-gradients", usage="%(prog)s [options]"
    )
    add_config_arguments(join, JoinConfig)
    join.set_defaults(handler=run_join)
    status = commands.add_parser("status", help="print the swarm's peers without training")
    status.add_argument(
        "--peers",
        nargs="+",
        metavar="MADDR",
        help="any members (default: the nodes running on this machine)",
    )
    status.add_argument(
        "--run-id", default=None, help="run to show (default: every run found through the peers)"
    )
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument(
        "--page", type=int, default=1, help="which page of peers to show (from 1; default 1)"
    )
    status.add_argument(
        "--page-size",
        type=page_size,
        default=DEFAULT_PAGE_SIZE,
        help=f"peers per page (default {DEFAULT_PAGE_SIZE}); the swarm's totals cover every peer",
    )
    status.set_defaults(handler=run_status)
    dashboard = commands.add_parser(
        "dashboard", help="serve the swarm dashboard in a browser without training"
    )
    add_config_arguments(dashboard, StandaloneConfig)
    dashboard.set_defaults(handler=run_dashboard)
    export = commands.add_parser(
        "export", help="write a checkpoint's model as safetensors + config.json (transformers)"
    )
    export.add_argument("--checkpoint-dir", required=True, help="directory join checkpointed to")
    export.add_argument("--out", required=True, help="directory to write the model to")
    export.add_argument(
        "--model", help="model the run trained, for a checkpoint that does not record it"
    )
    export.set_defaults(handler=run_export)
    add_doctor_command(commands)
    add_bootstrap_command(commands)
    keygen = commands.add_parser("keygen", help="create an Ed25519 identity key")
    keygen.add_argument("--identity", default=DEFAULT_IDENTITY, help="key file to write")
    keygen.add_argument("--force", action="store_true", help="replace an existing key")
    keygen.add_argument(
        "--peer-id",
        action="store_true",
        help="print only the peer id, creating the key if it is missing (for scripts)",
    )
    keygen.set_defaults(handler=run_keygen)
    return parser


def add_doctor_command(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    doctor = commands.add_parser(
        "doctor", help="say whether peers can reach this node (NAT, relay) before joining"
    )
    doctor.add_argument("--peers", nargs="*", default=[], metavar="MADDR", help="bootstrap peers")
    doctor.add_argument("--host", default="0.0.0.0", help="address join would listen on")
    doctor.add_argument("--port", type=int, default=0, help="port join would listen on")
    doctor.add_argument("--announce", nargs="*", default=[], metavar="MADDR", help="as join's")
    doctor.add_argument(
        "--wait", type=float, default=40.0, help="seconds to wait for AutoNAT and a relay"
    )
    doctor.set_defaults(handler=run_doctor)


def run_doctor(args: argparse.Namespace) -> int:
    """Prints the verdict's lines; exit status 1 when no peer could reach this node."""
    import asyncio

    from dht.addresses import listen_maddrs, parse_announce_maddr, parse_peer_maddr
    from dht.doctor import Verdict, diagnose

    peers = [str(parse_peer_maddr(p)) for p in args.peers]
    announce = [str(parse_announce_maddr(a)) for a in args.announce]
    if not 1 <= args.wait <= 600:
        raise UserError(f"--wait must be 1 to 600 seconds, got {args.wait}")
    seen = asyncio.run(
        diagnose(peers, listen_maddrs(args.host, args.port), announce, wait_s=args.wait)
    )
    verdict = Verdict(seen)
    print("\n".join(verdict.lines()))
    return 0 if verdict.ok else 1


DEFAULT_BOOTSTRAP_IDENTITY = str(Path(DEFAULT_IDENTITY).with_name("bootstrap.key"))
"""`diloco-node bootstrap`'s key: not join's identity.key, so a bootstrap and a training node
on one machine are two peers."""


def add_bootstrap_command(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    boot = commands.add_parser(
        "bootstrap", help="serve the DHT and relay for peers behind NAT, without training"
    )
    boot.add_argument("--host", default="0.0.0.0", help="address to listen on")
    boot.add_argument("--port", type=int, default=31337, help="TCP port to listen on")
    boot.add_argument(
        "--announce",
        nargs="+",
        required=True,
        metavar="MADDR",
        help="this machine's public address",
    )
    boot.add_argument("--peers", nargs="*", default=[], metavar="MADDR", help="other bootstraps")
    boot.add_argument(
        "--identity",
        default=None,
        metavar="PATH",
        help="key file that keeps this bootstrap's peer id across restarts, created if missing "
        f"(default: {DEFAULT_BOOTSTRAP_IDENTITY}, or the first free bootstrap-N.key beside it)",
    )
    boot.add_argument("--relay-max-circuits", type=int, default=16, help="as join's")
    boot.add_argument("--relay-max-mb", type=float, default=1024.0, help="as join's")
    boot.add_argument("--relay-max-duration", type=float, default=1200.0, help="as join's")
    boot.set_defaults(handler=run_bootstrap_command)


def run_bootstrap_command(args: argparse.Namespace) -> int:
    from dht.addresses import listen_maddrs, parse_announce_maddr, parse_peer_maddr
    from dht.bootstrap import run_bootstrap
    from dht.reachability import RelayLimits

    limits = RelayLimits(
        max_circuits=args.relay_max_circuits,
        max_bytes=int(args.relay_max_mb * 1e6),
        max_duration_s=args.relay_max_duration,
    )
    announce = [str(parse_announce_maddr(a)) for a in args.announce]
    peers = [str(parse_peer_maddr(p)) for p in args.peers]
    path, lock = bootstrap_identity(args.identity)
    try:
        identity, created = Identity.load_or_create(path)
        kept = "created" if created else "kept across restarts"
        print(f"identity {path} ({kept}): peer id {identity.peer_id}", flush=True)
        stop = threading.Event()
        with stop_on_signals(stop.set):
            run_bootstrap(
                listen_maddrs(args.host, args.port),
                announce,
                limits,
                stop,
                identity_path=str(path),
                initial_peers=peers,
            )
    finally:
        lock.release()
    return 0


def bootstrap_identity(flag: str | None) -> tuple[Path, ResourceLock]:
    """The key file a bootstrap runs as, locked against another process on this machine.

    --identity held by another process is an error naming the flag; the default held by
    another bootstrap moves this one to the first free `bootstrap-N.key` beside it (join's
    rule, node.locks.lock_identity), which it takes again whenever it is free."""
    wanted = Path(flag or DEFAULT_BOOTSTRAP_IDENTITY).expanduser()
    path, lock = lock_identity(wanted, is_default=flag is None)
    if path != wanted:
        print(
            f"diloco-node: warning: identity {wanted} is in use by another bootstrap on this "
            f"machine; this one runs as {path}",
            file=sys.stderr,
        )
    return path, lock


def run_join(args: argparse.Namespace) -> int:
    with bounded_allocator(os.environ) as allocator:  # before the node's threads exist
        return join(args, allocator)


def join(args: argparse.Namespace, allocator: Allocator) -> int:
    args = with_swarm_run(args)
    config = config_from_args(JoinConfig, args)
    # torch loads here, with the node: --help, --version and a bad flag answer without it
    with interrupts_deferred():  # Ctrl+C inside torch's import: node/entry.py
        from node.app import build_events
        from node.multigpu import run_multiprocess_join
        from node.ranks import torchrun_rank
        from node.runtime import Node

    if config.nproc_per_node > 1 or torchrun_rank() is not None:
        return run_multiprocess_join(config, args.argv)
    configure_logging(config.log_level, config.log_format)
    events = build_events(config)
    events.emit("allocator", **allocator.fields())
    try:
        node = Node(config, events)
        with stop_on_signals(node.request_stop, node.request_finish):
            node.run()
    finally:
        events.emit("allocator_trims", **allocator.trims.fields())
        events.close()
    return 0


def with_swarm_run(args: argparse.Namespace) -> argparse.Namespace:
    """`join --peers M` without --run-id: the run the swarm trains, with its settings (flags
    on the command line still win); unchanged when the swarm trains none yet."""
    argv: list[str] = args.argv
    join_args = argv[argv.index("join") + 1 :] if "join" in argv else argv
    peers, swarm = flag_value(args, "peers"), flag_value(args, "swarm") is not False
    named = flag_value(args, "run_id") is not None or run_id_given(join_args)
    if not peers or not swarm or named:
        return args
    run = choose_run(discover_runs(peers))
    if run is None:
        return args
    print(
        f"the swarm trains one run, {run.describe()}: joining it "
        "(--run-id RUN to start or join another)",
        file=sys.stderr,
    )
    new_argv = ["join", *run.join_flags(), *join_args]
    chosen = build_parser().parse_args(new_argv)
    chosen.argv = new_argv  # a multi-GPU join's ranks re-execute this, naming the run
    return chosen


def discover_runs(peers: list[str]) -> list[SwarmRun]:
    """The runs with live peers in the swarm reached through `peers` ([] if unreachable:
    the join then says so itself, after its retries)."""
    from dht.observer import SwarmObserver  # hivemind: not imported by a join with --run-id

    maddrs = [str(parse_peer_maddr(p)) for p in peers]
    try:
        with SwarmObserver(maddrs) as observer:
            runs = []
            for run_id in observer.run_ids():
                live = [snap for snap in observer.snapshot(run_id) if snap.peers]
                if live:
                    runs.append(swarm_run(run_id, [snap.run_summary for snap in live]))
            return runs
    except SwarmError as exc:
        logger.warning(
            "could not list the swarm's runs (%s); joining with the flags given (--run-id "
            "names a run)",
            exc,
        )
        return []


def run_status(args: argparse.Namespace) -> int:
    from dht.observer import SwarmObserver
    from node.status import print_status  # both import hivemind: not on a join's start-up

    peers = [str(parse_peer_maddr(p)) for p in args.peers or local_peers()]
    with SwarmObserver(peers) as observer:
        run_ids = [args.run_id] if args.run_id is not None else observer.run_ids()
        snapshots = [snap for run_id in run_ids for snap in observer.snapshot(run_id)]
    print_status(args.run_id, snapshots, as_json=args.json, page=(args.page, args.page_size))
    return 0


def local_peers() -> list[str]:
    """The addresses of the nodes running on this machine (their control files), said on
    stderr (stdout may be status's JSON); UserError when there is none."""
    directory = nodes_dir()
    nodes = find_local_nodes(directory) if directory.is_dir() else []
    if not nodes:
        raise UserError(
            f"no node runs on this machine (none announced in {directory}); "
            "pass --peers MADDR of any member of the swarm"
        )
    listed = ", ".join(f"{n.peer_id} (run '{n.run_id}', pid {n.pid})" for n in nodes)
    print(f"nodes on this machine: {listed}", file=sys.stderr)
    return [n.dial_maddr() for n in nodes]


def run_dashboard(args: argparse.Namespace) -> int:
    config = config_from_args(StandaloneConfig, args)
    configure_logging(config.log_level, config.log_format)
    events: EventLog = JsonEventLog() if config.log_format == "json" else _LoggedEvents()
    stop = threading.Event()
    try:
        with stop_on_signals(stop.set):
            serve_dashboard(config, events, stop)
    finally:
        events.close()
    return 0


class _LoggedEvents:
    """For people: the dashboard's one event, its URL, as a log line."""

    def emit(self, event: str, **fields: object) -> None:
        if event == "dashboard":
            logger.info("dashboard for run '%s' at %s", fields["run_id"], fields["url"])

    def progress(self, **fields: object) -> None:
        """The dashboard has no progress to show."""

    def close(self) -> None:
        """Nothing to release."""


def run_export(args: argparse.Namespace) -> int:
    with interrupts_deferred():  # torch: not for the other commands' start
        from node.export import export_checkpoint

    checkpoint_dir = Path(args.checkpoint_dir).expanduser()
    result = export_checkpoint(checkpoint_dir, Path(args.out).expanduser(), args.model)
    print(
        f"wrote {result.out}: {result.model}, {result.num_params:,} parameters, "
        f"replica of round {result.round}"
    )
    if result.num_applied == 0:
        print(
            "diloco-node: warning: this replica has merged no update yet: the exported model "
            "is untrained (the run's initial weights)",
            file=sys.stderr,
        )
    return 0


def run_keygen(args: argparse.Namespace) -> int:
    path = Path(args.identity).expanduser()
    if args.peer_id and not args.force:
        identity, _ = Identity.load_or_create(path)
        print(identity.peer_id)
        return 0
    if path.exists() and not args.force:
        peer_id = Identity.load(path).peer_id
        raise UserError(f"{path} already holds the key of {peer_id}; pass --force to replace it")
    identity = Identity.generate()
    identity.save(path)
    print(f"wrote {path}\npeer id: {identity.peer_id}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    check_command_given(parser, argv)
    args = parser.parse_args(argv)
    args.argv = argv  # a multi-GPU join re-executes itself under torchrun with these
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        print("diloco-node: interrupted", file=sys.stderr)
        return 130
    except (UserError, ValueError, OSError) as exc:
        logger.debug("failed", exc_info=True)
        print(f"diloco-node: error: {str(exc) or type(exc).__name__}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
