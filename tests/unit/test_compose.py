"""docker-compose.yml and the Dockerfile agree with the CLI: no Docker engine, no network.

Each node's command line is rebuilt the way Compose and `sh -c` would build it (Compose's
`$$` escape, the `$(diloco-node keygen ... --peer-id)` substitution run in-process against
temporary key files standing in for the named volumes, the shared run flags from the
environment), then parsed by the real CLI parser and validated by `JoinConfig` (the
dashboard's by `StandaloneConfig`, as `diloco-node dashboard` does). The mutation tests at
the end break a copy of the file in one way each and expect the same checks to fail.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import re
import shlex
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import multiaddr
import pytest
import yaml
from packaging.requirements import Requirement

from dashboard.settings import StandaloneConfig
from merge.identity import Identity
from node.cli import build_parser, main
from node.config import JoinConfig, dataclass_from_args

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"

NODES = ("bootstrap", "worker1", "worker2")
BOOTSTRAP = "bootstrap"
KEYS_SERVICE = "keys"
DASHBOARD = "dashboard"
TORCH_PIN = "torch==2.13.0"

# JoinConfig fields that may differ from node to node: where it listens, its role in the
# network, how it presents itself, its local resources and bookkeeping. Every other field
# (run id, seed, model, data, inner steps, batch size, outer optimizer, staleness, token
# weighting, codec, heartbeat period, and any field added later) must agree.
PER_NODE_FIELDS = frozenset(
    {
        "identity",
        "checkpoint_dir",
        "peers",
        "announce",
        "host",
        "port",
        "org",
        "device",
        "threads",
        "log_level",
        "log_format",
        "relay",
        "auto_relay",
        "client_mode",
        "serve_state",
        "checkpoint_every",
        "eval_batches",
        "retain_updates",
    }
)
# ...and of these, the ones a node must set itself rather than leave at the default.
REQUIRED_PER_NODE = ("identity", "checkpoint_dir")
DNS_PROTOCOLS = ("dns", "dns4", "dns6")


# --- reading the files -------------------------------------------------------------------


def load_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with comments dropped and continuation lines joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        pending = ""
    return instructions


def image_entrypoint(instructions: list[tuple[str, str]]) -> list[str]:
    entrypoints = [json.loads(args) for kind, args in instructions if kind == "ENTRYPOINT"]
    assert entrypoints, "the Dockerfile has no ENTRYPOINT"
    return entrypoints[-1]


# --- what Compose and sh would do --------------------------------------------------------


def compose_unescape(text: str, where: str) -> str:
    """Compose interpolation: `$$` is a literal `$`; any other `$` reads the host environment,
    which no node's command may depend on."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] != "$":
            out.append(text[i])
            i += 1
        elif text.startswith("$$", i):
            out.append("$")
            i += 2
        else:
            raise AssertionError(
                f"{where}: unescaped '$' at {text[i : i + 20]!r} would be read by Compose from "
                "the host environment (or rejected); write '$$' for the container's shell"
            )
    return "".join(out)


def environment_of(service: dict[str, Any], name: str) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {
        key: compose_unescape(str(value), f"{name}: environment {key}")
        for key, value in env.items()
    }


def named_mounts(compose: dict[str, Any], name: str) -> dict[PurePosixPath, str]:
    """Container path -> named volume, for the service's named-volume mounts."""
    declared = compose.get("volumes") or {}
    mounts: dict[PurePosixPath, str] = {}
    for entry in compose["services"][name].get("volumes") or []:
        source: str | None
        if isinstance(entry, dict):
            source, target = entry.get("source"), entry["target"]
        else:
            parts = entry.split(":")
            source, target = (parts[0], parts[1]) if len(parts) > 1 else (None, parts[0])
        if source is not None and source in declared:
            mounts[PurePosixPath(target)] = source
    return mounts


def host_path(
    compose: dict[str, Any], name: str, container_path: str, volumes: Path
) -> tuple[str, PurePosixPath, Path]:
    """Where a path inside the container lands: (named volume, path inside it, temp stand-in)."""
    path = PurePosixPath(container_path)
    assert path.is_absolute(), f"{name}: {container_path} is not an absolute path"
    for target, volume in sorted(
        named_mounts(compose, name).items(), key=lambda m: -len(m[0].parts)
    ):
        if path.is_relative_to(target) and path != target:
            inner = path.relative_to(target)
            return volume, inner, volumes / volume / inner
    raise AssertionError(
        f"{name}: {container_path} is not on a named volume, so it would not survive the container"
    )


def run_cli_in_process(argv: list[str]) -> str:
    """`diloco-node ARGV` through node.cli.main; returns its stdout."""
    out, err = io.StringIO(), io.StringIO()
    code: str | int | None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    assert code == 0, f"diloco-node {shlex.join(argv)} failed ({code}): {err.getvalue().strip()}"
    return out.getvalue()


def run_keygen(
    compose: dict[str, Any], name: str, argv: list[str], volumes: Path
) -> tuple[str, tuple[str, PurePosixPath]]:
    """Runs a service's `keygen --peer-id` against the temp volumes: (peer id, key location)."""
    args = parse_cli(name, argv)
    assert args.command == "keygen" and args.peer_id and not args.force, (
        f"{name}: expected `diloco-node keygen --identity KEY --peer-id`, got {argv}"
    )
    volume, inner, path = host_path(compose, name, args.identity, volumes)
    path.parent.mkdir(parents=True, exist_ok=True)
    printed = run_cli_in_process(["keygen", "--identity", str(path), "--peer-id"]).strip()
    assert printed == Identity.load(path).peer_id, f"{name}: keygen printed {printed!r}"
    return printed, (volume, inner)


_SUBSTITUTION = re.compile(r"\$\(([^()]*)\)")
_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")
# Characters whose meaning is the same to shlex and to sh's word splitting of `$VAR`.
_PLAIN_WORDS = re.compile(r"[\w ./:=,+-]*")


def expand_shell(
    compose: dict[str, Any], name: str, script: str, volumes: Path
) -> tuple[list[str], list[tuple[str, PurePosixPath]]]:
    """argv that `sh -c SCRIPT` would exec, and the key files its substitutions read."""
    assert "'" not in script and "`" not in script, f"{name}: keep the script free of ' and `"
    keys_read: list[tuple[str, PurePosixPath]] = []

    def substitute(match: re.Match[str]) -> str:
        inner = shlex.split(match.group(1))
        assert inner[:1] == ["diloco-node"], f"{name}: unexpected substitution $({match[1]})"
        peer_id, key = run_keygen(compose, name, inner[1:], volumes)
        keys_read.append(key)
        return peer_id

    env = environment_of(compose["services"][name], name)

    def variable(match: re.Match[str]) -> str:
        var = match.group(1) or match.group(2)
        assert var in env, f"{name}: ${var} is not set in the service's environment"
        assert _PLAIN_WORDS.fullmatch(env[var]), f"{name}: ${var} needs shell quoting"
        return env[var]

    expanded = _VARIABLE.sub(variable, _SUBSTITUTION.sub(substitute, script))
    assert "$" not in expanded, f"{name}: unsupported shell expansion left in {expanded!r}"
    argv = shlex.split(expanded)
    assert argv[:2] == ["exec", "diloco-node"], (
        f"{name}: the script must `exec diloco-node ...` so that SIGTERM reaches the node"
    )
    return argv[2:], keys_read


def service_argv(
    compose: dict[str, Any], name: str, volumes: Path, image_ep: list[str]
) -> tuple[list[str], list[tuple[str, PurePosixPath]]]:
    """The argv diloco-node receives in a service, as Compose would start it."""
    service = compose["services"][name]
    entrypoint = service.get("entrypoint", image_ep)
    if isinstance(entrypoint, str):
        entrypoint = shlex.split(entrypoint)
    command = service.get("command")
    if isinstance(command, str):
        command = shlex.split(command)  # what Compose does with a string command
    assert isinstance(command, list), f"{name}: no command"
    command = [compose_unescape(str(c), f"{name}: command") for c in command]
    if entrypoint == ["diloco-node"]:
        return command, []
    assert entrypoint == ["sh", "-c"], f"{name}: unexpected entrypoint {entrypoint}"
    assert len(command) == 1, (
        f"{name}: with `sh -c` the command must be a list of one script, got {len(command)} "
        "words (Compose splits a string command into words)"
    )
    return expand_shell(compose, name, command[0], volumes)


def parse_cli(name: str, argv: list[str]) -> Any:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return build_parser().parse_args(argv)
        except SystemExit:
            pass
    raise AssertionError(f"{name}: diloco-node rejects {argv}: {err.getvalue().strip()}")


# --- the swarm as Compose would start it -------------------------------------------------


@dataclass
class NodeSpec:
    name: str
    argv: list[str]
    config: JoinConfig
    keys_read: list[tuple[str, PurePosixPath]]


@dataclass
class DashboardSpec:
    argv: list[str]
    config: StandaloneConfig
    keys_read: list[tuple[str, PurePosixPath]]


@dataclass
class Swarm:
    compose: dict[str, Any]
    volumes: Path
    dockerfile: list[tuple[str, str]]
    keys_peer_id: str
    keys_key: tuple[str, PurePosixPath]
    nodes: dict[str, NodeSpec]
    dashboard: DashboardSpec

    def peer_id_of(self, name: str) -> str:
        path = host_path(self.compose, name, self.nodes[name].config.identity, self.volumes)[2]
        return Identity.load(path).peer_id


def start_swarm(compose: dict[str, Any], volumes: Path, dockerfile_text: str) -> Swarm:
    """Runs `keys`, then builds and validates each node's command line in start order, then
    the dashboard's."""
    services = compose["services"]
    assert set(NODES) | {KEYS_SERVICE, DASHBOARD} <= set(services), f"services: {sorted(services)}"
    instructions = dockerfile_instructions(dockerfile_text)
    image_ep = image_entrypoint(instructions)
    keys_argv, _ = service_argv(compose, KEYS_SERVICE, volumes, image_ep)
    keys_peer_id, keys_key = run_keygen(compose, KEYS_SERVICE, keys_argv, volumes)
    nodes: dict[str, NodeSpec] = {}
    for name in NODES:
        argv, keys_read = service_argv(compose, name, volumes, image_ep)
        args = parse_cli(name, argv)
        assert args.command == "join", f"{name}: runs `{args.command}`, not `join`"
        try:
            config = dataclass_from_args(JoinConfig, args)
        except ValueError as exc:
            raise AssertionError(f"{name}: invalid configuration: {exc}") from exc
        # As `join` does first: load the node's key, or create it on the keys volume.
        identity_path = host_path(compose, name, config.identity, volumes)[2]
        Identity.load_or_create(identity_path)
        nodes[name] = NodeSpec(name, argv, config, keys_read)
    argv, keys_read = service_argv(compose, DASHBOARD, volumes, image_ep)
    args = parse_cli(DASHBOARD, argv)
    assert args.command == "dashboard", f"{DASHBOARD}: runs `{args.command}`, not `dashboard`"
    try:  # as `diloco-node dashboard` validates its flags before it serves
        dashboard_config = dataclass_from_args(StandaloneConfig, args)
    except ValueError as exc:
        raise AssertionError(f"{DASHBOARD}: invalid configuration: {exc}") from exc
    dashboard = DashboardSpec(argv, dashboard_config, keys_read)
    return Swarm(compose, volumes, instructions, keys_peer_id, keys_key, nodes, dashboard)


# --- the checks --------------------------------------------------------------------------


def container_ports(service: dict[str, Any], name: str) -> tuple[set[int], set[int]]:
    """(published container ports, exposed-only container ports) of a service."""
    published: set[int] = set()
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            target = str(entry["target"])
        else:
            spec, _, protocol = str(entry).partition("/")
            assert protocol in ("", "tcp"), f"{name}: libp2p needs tcp, got {entry}"
            target = spec.rsplit(":", 1)[-1]
        assert target.isdigit(), f"{name}: container port range {entry} is not supported"
        published.add(int(target))
    exposed = {int(str(p).partition("/")[0]) for p in service.get("expose") or []}
    return published, exposed


def check_ports(swarm: Swarm) -> None:
    """Each node listens on all interfaces, on the one port its service publishes/exposes."""
    for name, node in swarm.nodes.items():
        config = node.config
        assert config.host in ("0.0.0.0", "::"), (
            f"{name}: --host {config.host} is unreachable from the other containers"
        )
        published, exposed = container_ports(swarm.compose["services"][name], name)
        assert published | exposed == {config.port}, (
            f"{name}: listens on --port {config.port} but its service declares container "
            f"ports {sorted(published | exposed)}"
        )
        if name == BOOTSTRAP:
            assert config.port in published, f"{name}: --port {config.port} is not published"
    image_exposed = {
        int(p.partition("/")[0])
        for kind, args in swarm.dockerfile
        if kind == "EXPOSE"
        for p in args.split()
    }
    bootstrap_port = swarm.nodes[BOOTSTRAP].config.port
    assert bootstrap_port in image_exposed, f"the Dockerfile does not EXPOSE {bootstrap_port}"


def parse_maddr(name: str, text: str) -> dict[str, str]:
    try:
        maddr = multiaddr.Multiaddr(text)
    except Exception as exc:
        raise AssertionError(f"{name}: {text!r} is not a multiaddr: {exc}") from exc
    return {protocol.name: value for protocol, value in maddr.items()}


def check_peers(swarm: Swarm) -> None:
    """Every worker dials a node of the compose file by service name, port and peer id."""
    bootstrap = swarm.nodes[BOOTSTRAP].config
    assert not bootstrap.peers, f"{BOOTSTRAP}: starts the swarm, so it needs no --peers"
    for announced in bootstrap.announce or []:
        parts = parse_maddr(BOOTSTRAP, announced)
        host = next((parts[p] for p in DNS_PROTOCOLS if p in parts), None)
        assert host == BOOTSTRAP, f"{BOOTSTRAP}: announces {announced}, not its service name"
        assert parts.get("tcp") == str(bootstrap.port), (
            f"{BOOTSTRAP}: announces {announced} but listens on --port {bootstrap.port}"
        )
    for name, node in swarm.nodes.items():
        if name == BOOTSTRAP:
            continue
        assert node.config.peers, f"{name}: no --peers, so it would start a swarm of its own"
        dialled = set()
        for peer in node.config.peers:
            parts = parse_maddr(name, peer)
            target = next((parts[p] for p in DNS_PROTOCOLS if p in parts), None)
            assert target in swarm.nodes and target != name, (
                f"{name}: --peers {peer} does not name another node's service"
            )
            assert parts.get("tcp") == str(swarm.nodes[target].config.port), (
                f"{name}: --peers {peer} dials the wrong port; {target} listens on "
                f"--port {swarm.nodes[target].config.port}"
            )
            assert parts.get("p2p") == swarm.peer_id_of(target), (
                f"{name}: --peers {peer} does not carry {target}'s peer id "
                f"{swarm.peer_id_of(target)}"
            )
            dialled.add(target)
        assert BOOTSTRAP in dialled, f"{name}: does not join through {BOOTSTRAP}"


def check_keys_service(swarm: Swarm) -> None:
    """`keys` makes the bootstrap node's key; nodes start after it, workers after bootstrap."""
    bootstrap_key = host_path(
        swarm.compose, BOOTSTRAP, swarm.nodes[BOOTSTRAP].config.identity, swarm.volumes
    )[:2]
    assert swarm.keys_key == bootstrap_key, (
        f"{KEYS_SERVICE}: creates {swarm.keys_key}, but {BOOTSTRAP} uses {bootstrap_key}"
    )
    assert swarm.keys_peer_id == swarm.peer_id_of(BOOTSTRAP)
    services = swarm.compose["services"]
    assert services[KEYS_SERVICE].get("restart", "no") in ("no", "on-failure"), (
        f"{KEYS_SERVICE}: a one-shot service must not restart once it has succeeded"
    )
    for name, node in swarm.nodes.items():
        depends_on = services[name].get("depends_on") or {}
        if isinstance(depends_on, list):
            depends_on = {dep: {"condition": "service_started"} for dep in depends_on}
        condition = (depends_on.get(KEYS_SERVICE) or {}).get("condition")
        assert condition == "service_completed_successfully", (
            f"{name}: must wait for {KEYS_SERVICE} to complete successfully, got {condition}"
        )
        for key in node.keys_read:
            assert key == bootstrap_key, f"{name}: reads the peer id of {key}, not {bootstrap_key}"
        if name != BOOTSTRAP:
            assert BOOTSTRAP in depends_on, f"{name}: does not start after {BOOTSTRAP}"


def check_shared_run(swarm: Swarm) -> dict[str, Any]:
    """All nodes agree on every run-level field: run id, model, seed, merge settings..."""
    run_fields = [f.name for f in dataclasses.fields(JoinConfig) if f.name not in PER_NODE_FIELDS]
    assert {"run_id", "model", "seed", "inner_steps", "outer_optimizer", "staleness"} <= set(
        run_fields
    )
    reference_name = BOOTSTRAP
    reference = {f: getattr(swarm.nodes[reference_name].config, f) for f in run_fields}
    for name, node in swarm.nodes.items():
        differing = {
            f: (reference[f], getattr(node.config, f))
            for f in run_fields
            if getattr(node.config, f) != reference[f]
        }
        assert not differing, f"{name} and {reference_name} would train different runs: {differing}"
    return reference


def check_storage(swarm: Swarm) -> None:
    """Distinct identities and checkpoint dirs, all on the declared named volumes."""
    declared = set(swarm.compose.get("volumes") or {})
    assert {"keys", "checkpoints"} <= declared, f"named volumes: {sorted(declared)}"
    identities: dict[tuple[str, PurePosixPath], str] = {}
    checkpoints: dict[tuple[str, PurePosixPath], str] = {}
    for name, node in swarm.nodes.items():
        for flag in REQUIRED_PER_NODE:
            assert f"--{flag.replace('_', '-')}" in node.argv, f"{name}: --{flag} is not set"
        assert node.config.checkpoint_dir is not None
        identity = host_path(swarm.compose, name, node.config.identity, swarm.volumes)[:2]
        checkpoint = host_path(swarm.compose, name, node.config.checkpoint_dir, swarm.volumes)[:2]
        assert identity[0] == "keys", f"{name}: --identity is not on the keys volume"
        assert checkpoint[0] == "checkpoints", f"{name}: --checkpoint-dir not on checkpoints"
        assert identity not in identities, (
            f"{name} and {identities.get(identity)} share the identity {identity}"
        )
        for other, other_name in checkpoints.items():
            nested = other[0] == checkpoint[0] and (
                other[1].is_relative_to(checkpoint[1]) or checkpoint[1].is_relative_to(other[1])
            )
            assert not nested, f"{name} and {other_name} share the checkpoint dir {checkpoint}"
        identities[identity] = name
        checkpoints[checkpoint] = name


def check_dashboard(swarm: Swarm) -> None:
    """The dashboard serves on the port it publishes, watches the nodes' run, and finds the
    swarm through the bootstrap node, whose key must exist before it starts."""
    config = swarm.dashboard.config
    assert config.host in ("0.0.0.0", "::"), (
        f"{DASHBOARD}: --host {config.host} is unreachable through the published port"
    )
    published, exposed = container_ports(swarm.compose["services"][DASHBOARD], DASHBOARD)
    assert published == {config.port} and not exposed - published, (
        f"{DASHBOARD}: serves on --port {config.port} but its service publishes container "
        f"ports {sorted(published)}"
    )
    for name, node in swarm.nodes.items():
        assert config.run_id == node.config.run_id, (
            f"{DASHBOARD}: watches --run-id {config.run_id}, but {name} trains "
            f"--run-id {node.config.run_id}"
        )
    assert config.peers, f"{DASHBOARD}: no --peers"
    bootstrap = swarm.nodes[BOOTSTRAP].config
    for peer in config.peers:
        parts = parse_maddr(DASHBOARD, peer)
        target = next((parts[p] for p in DNS_PROTOCOLS if p in parts), None)
        assert target == BOOTSTRAP, f"{DASHBOARD}: --peers {peer} does not name {BOOTSTRAP}"
        assert parts.get("tcp") == str(bootstrap.port), (
            f"{DASHBOARD}: --peers {peer} dials the wrong port; {BOOTSTRAP} listens on "
            f"--port {bootstrap.port}"
        )
        assert parts.get("p2p") == swarm.peer_id_of(BOOTSTRAP), (
            f"{DASHBOARD}: --peers {peer} does not carry {BOOTSTRAP}'s peer id "
            f"{swarm.peer_id_of(BOOTSTRAP)}"
        )
    bootstrap_key = host_path(swarm.compose, BOOTSTRAP, bootstrap.identity, swarm.volumes)[:2]
    assert swarm.dashboard.keys_read == [bootstrap_key], (
        f"{DASHBOARD}: reads the peer id of {swarm.dashboard.keys_read}, not {bootstrap_key}"
    )
    depends_on = swarm.compose["services"][DASHBOARD].get("depends_on") or {}
    if isinstance(depends_on, list):
        depends_on = {dep: {"condition": "service_started"} for dep in depends_on}
    condition = (depends_on.get(KEYS_SERVICE) or {}).get("condition")
    assert condition == "service_completed_successfully", (
        f"{DASHBOARD}: must wait for {KEYS_SERVICE} to complete successfully, got {condition}"
    )
    assert BOOTSTRAP in depends_on, f"{DASHBOARD}: does not start after {BOOTSTRAP}"


def check_dockerfile(text: str) -> None:
    instructions = dockerfile_instructions(text)
    assert instructions and instructions[0] == ("FROM", "python:3.11-slim"), instructions[:1]
    runs = [args for kind, args in instructions if kind == "RUN"]
    assert any(re.search(rf"pip install {re.escape(TORCH_PIN)} \.(\s|$)", r) for r in runs), (
        f"the Dockerfile does not `pip install {TORCH_PIN} .`"
    )
    assert image_entrypoint(instructions) == ["diloco-node"]
    users = [args for kind, args in instructions if kind == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image runs as root"
    volumes = {
        v
        for kind, args in instructions
        if kind == "VOLUME"
        for v in (json.loads(args) if args.startswith("[") else args.split())
    }
    assert {"/keys", "/checkpoints"} <= volumes, f"VOLUME {sorted(volumes)}"
    assert "31337" in {a for kind, args in instructions if kind == "EXPOSE" for a in args.split()}
    # Cacheable: pyproject.toml is copied (and the dependencies installed) before any source.
    copies = [
        (i, args.split()[:-1]) for i, (kind, args) in enumerate(instructions) if kind == "COPY"
    ]
    pyproject_at = [i for i, sources in copies if sources == ["pyproject.toml"]]
    sources_at = [i for i, sources in copies if set(sources) & {"node", ".", "./"}]
    torch_at = [
        i for i, (kind, args) in enumerate(instructions) if kind == "RUN" and TORCH_PIN in args
    ]
    assert pyproject_at and sources_at and torch_at, "pyproject.toml, sources or torch not found"
    assert pyproject_at[0] < torch_at[0] < min(sources_at), (
        "the sources are copied before the dependencies are installed, so every code change "
        "would reinstall torch"
    )


# --- tests of the real files -------------------------------------------------------------


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Swarm:
    """Started once for the module: the tests below only read it (and its key files)."""
    volumes = tmp_path_factory.mktemp("volumes")
    return start_swarm(load_compose(), volumes, DOCKERFILE.read_text())


def test_each_node_command_is_accepted_by_the_cli(swarm: Swarm) -> None:
    assert set(swarm.nodes) == set(NODES)
    for node in swarm.nodes.values():
        assert node.argv[0] == "join"


def test_ports_match_what_each_service_publishes(swarm: Swarm) -> None:
    check_ports(swarm)
    assert swarm.nodes[BOOTSTRAP].config.port == 31337


def test_workers_join_through_the_bootstrap_node(swarm: Swarm) -> None:
    check_peers(swarm)
    bootstrap_id = swarm.peer_id_of(BOOTSTRAP)
    assert bootstrap_id.startswith("12D3KooW")
    for name in ("worker1", "worker2"):
        assert swarm.nodes[name].config.peers == [f"/dns4/bootstrap/tcp/31337/p2p/{bootstrap_id}"]


def test_keys_service_creates_the_bootstrap_key_first(swarm: Swarm) -> None:
    check_keys_service(swarm)


def test_all_nodes_share_the_run_settings(swarm: Swarm) -> None:
    run = check_shared_run(swarm)
    assert run["run_id"] != JoinConfig.run_id, "use a run id of its own, not the default"
    assert run["model"] in ("tiny", "small", "base")


def test_run_settings_come_from_one_anchor() -> None:
    text = COMPOSE_FILE.read_text()
    # --run-id twice: in the shared anchor, and in the dashboard's command, which takes no
    # training flags and which check_dashboard ties to the nodes' run id.
    assert text.count("--run-id") == 2 and text.count("--model") == 1, (
        "the run flags belong in the shared anchor only"
    )
    services = load_compose()["services"]
    assert all("--run-id" not in services[name]["command"][0] for name in NODES)
    envs = [services[name].get("environment") for name in NODES]
    assert all(env == envs[0] for env in envs)


def test_each_node_has_its_own_identity_and_checkpoints(swarm: Swarm) -> None:
    check_storage(swarm)
    peer_ids = {swarm.peer_id_of(name) for name in NODES}
    assert len(peer_ids) == len(NODES)


def test_dashboard_watches_the_swarm_through_the_bootstrap_node(swarm: Swarm) -> None:
    check_dashboard(swarm)
    dashboard = swarm.dashboard
    assert dashboard.argv[0] == "dashboard"
    assert dashboard.config.host == "0.0.0.0" and dashboard.config.port == 8000
    assert container_ports(swarm.compose["services"][DASHBOARD], DASHBOARD) == ({8000}, set())
    assert dashboard.config.run_id == check_shared_run(swarm)["run_id"]
    bootstrap_id = swarm.peer_id_of(BOOTSTRAP)
    assert dashboard.config.peers == [f"/dns4/bootstrap/tcp/31337/p2p/{bootstrap_id}"]
    assert "http://localhost:8000/" in COMPOSE_FILE.read_text()


def test_dockerfile_installs_the_tested_torch_and_runs_diloco_node() -> None:
    check_dockerfile(DOCKERFILE.read_text())
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    torch_req = next(
        Requirement(r) for r in pyproject["project"]["dependencies"] if r.startswith("torch")
    )
    assert torch_req.specifier.contains(TORCH_PIN.split("==")[1])


def test_dockerignore_keeps_caches_git_and_artifacts_out() -> None:
    patterns = {
        line.strip().rstrip("/")
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for required in (".git", "**/__pycache__", ".pytest_cache", "tests/artifacts", "**/*.key"):
        assert required in patterns, f".dockerignore does not exclude {required}"
    for needed in ("pyproject.toml", "README.md", "node", "merge", "dht", "dashboard"):
        assert needed not in patterns, f".dockerignore excludes {needed}, which the image needs"


# --- the checks fail on broken copies ----------------------------------------------------


def _edit_command(name: str, old: str, new: str) -> Callable[[dict[str, Any]], None]:
    def edit(compose: dict[str, Any]) -> None:
        command = compose["services"][name]["command"]
        assert old in command[0], f"mutation target {old!r} not in {name}'s command"
        command[0] = command[0].replace(old, new)

    return edit


def _set(path: tuple[str, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(compose: dict[str, Any]) -> None:
        target = compose
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


def _drop_keys_dependency(compose: dict[str, Any]) -> None:
    del compose["services"]["worker2"]["depends_on"][KEYS_SERVICE]


def _string_command(compose: dict[str, Any]) -> None:
    service = compose["services"]["worker1"]
    service["command"] = service["command"][0]


def _all_checks(swarm: Swarm) -> None:
    check_ports(swarm)
    check_peers(swarm)
    check_keys_service(swarm)
    check_shared_run(swarm)
    check_storage(swarm)
    check_dashboard(swarm)


PEERS = "/dns4/bootstrap/tcp/31337/p2p/"
KEYGEN = "keygen --identity /keys/bootstrap.key"

MUTATIONS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "worker dials port 31338": (
        _edit_command("worker1", PEERS, "/dns4/bootstrap/tcp/31338/p2p/"),
        "wrong port",
    ),
    "unknown flag": (_edit_command("worker2", "--org compose", "--no-such-flag 1"), "rejects"),
    "invalid value": (
        _edit_command("worker1", "--org compose", "--outer-momentum 1.5"),
        "invalid configuration",
    ),
    "worker overrides a run flag": (
        _edit_command("worker2", "--org compose", "--inner-steps 20"),
        "would train different runs",
    ),
    "worker reads its own key as the bootstrap's": (
        _edit_command("worker1", KEYGEN, "keygen --identity /keys/worker1.key"),
        "peer id",
    ),
    "worker dials a host that is no service": (
        _edit_command("worker2", PEERS, "/dns4/bootstrapp/tcp/31337/p2p/"),
        "does not name another node",
    ),
    "bootstrap listens on another port than it publishes": (
        _edit_command(BOOTSTRAP, "--port 31337", "--port 31338"),
        "declares container ports",
    ),
    "bootstrap announces another port": (
        _edit_command(BOOTSTRAP, "/dns4/bootstrap/tcp/31337", "/dns4/bootstrap/tcp/4001"),
        "announces",
    ),
    "bootstrap listens on loopback": (
        _edit_command(BOOTSTRAP, "--host 0.0.0.0", "--host 127.0.0.1"),
        "unreachable",
    ),
    "two workers share an identity": (
        _edit_command("worker2", "/keys/worker2.key", "/keys/worker1.key"),
        "share the identity",
    ),
    "two workers share checkpoints": (
        _edit_command("worker2", "/checkpoints/worker2", "/checkpoints/worker1"),
        "share the checkpoint dir",
    ),
    "checkpoints off the volume": (
        _edit_command("worker1", "/checkpoints/worker1", "/tmp/worker1"),
        "not on a named volume",
    ),
    "compose interpolates the substitution": (
        _edit_command("worker1", "$$(diloco-node", "$(diloco-node"),
        "unescaped",
    ),
    "script given as a string command": (_string_command, "list of one script"),
    "missing run flags variable": (
        _set(("services", "worker2", "environment"), {}),
        "not set in the service's environment",
    ),
    "worker started before the keys exist": (_drop_keys_dependency, "must wait for keys"),
    "keys service makes another key": (
        _set(
            ("services", KEYS_SERVICE, "command"), ["keygen", "--identity", "/keys/k", "--peer-id"]
        ),
        "creates",
    ),
    "bootstrap port not published": (
        _set(("services", BOOTSTRAP, "ports"), []),
        "declares container ports",
    ),
    "dashboard serves another port than it publishes": (
        _edit_command(DASHBOARD, "--port 8000", "--port 8001"),
        "publishes container ports",
    ),
    "dashboard watches another run": (
        _edit_command(DASHBOARD, "--run-id compose-demo", "--run-id other"),
        "watches --run-id other",
    ),
}


@pytest.fixture(scope="module")
def intact_passes(swarm: Swarm) -> None:
    """Every check passes on the intact file (run once for the module, not once per mutation;
    each mutation test errors if it fails): a check that fails below fails for the mutation."""
    _all_checks(swarm)


@pytest.mark.usefixtures("intact_passes")
@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_checks_fail_on_a_broken_compose_file(tmp_path: Path, mutation: str) -> None:
    edit, message = MUTATIONS[mutation]
    broken = copy.deepcopy(load_compose())
    edit(broken)
    with pytest.raises(AssertionError, match=re.escape(message)):
        _all_checks(start_swarm(broken, tmp_path / "broken", DOCKERFILE.read_text()))


DOCKERFILE_MUTATIONS = {
    "another torch": (TORCH_PIN, "torch==2.12.0"),
    "no entrypoint": ('ENTRYPOINT ["diloco-node"]', ""),
    "runs as root": ("USER diloco", "USER root"),
    "another base image": ("FROM python:3.11-slim", "FROM python:3.12"),
    "sources before dependencies": (
        "COPY pyproject.toml ./\n",
        "COPY pyproject.toml ./\nCOPY node ./node\n",
    ),
    "sources only": ("COPY pyproject.toml ./\n", "COPY . ./\n"),
}


@pytest.mark.parametrize("mutation", list(DOCKERFILE_MUTATIONS))
def test_checks_fail_on_a_broken_dockerfile(mutation: str) -> None:
    old, new = DOCKERFILE_MUTATIONS[mutation]
    text = DOCKERFILE.read_text()
    assert old in text
    with pytest.raises(AssertionError):
        check_dockerfile(text.replace(old, new))
