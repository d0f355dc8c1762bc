"""tests/unit/test_compose.py's model of a Compose start, with no Docker engine: the files it
reads, each service's command line rebuilt as Compose and `sh -c` build it (`$$`, the
`$(diloco-node keygen ...)` substitution run in-process against temporary key files standing
in for the named volumes, the shared run flags from the environment), parsed by the real CLI
parser and validated as `join` and `dashboard` validate them (:func:`start_swarm`). Moved out
of test_compose.py unchanged (session 24).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

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
