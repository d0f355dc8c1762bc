"""The checks tests/unit/test_compose.py runs on a started :class:`Swarm` and on the Dockerfile;
its mutation tests expect each to fail on a copy broken one way. Moved out of
test_compose.py unchanged (session 24).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import PurePosixPath
from typing import Any

import multiaddr

from node.config import JoinConfig
from tests.unit.compose_swarm import (
    BOOTSTRAP,
    DASHBOARD,
    DNS_PROTOCOLS,
    KEYS_SERVICE,
    PER_NODE_FIELDS,
    REQUIRED_PER_NODE,
    TORCH_PIN,
    Swarm,
    dockerfile_instructions,
    host_path,
    image_entrypoint,
)


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
