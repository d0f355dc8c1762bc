"""docker-compose.yml and the Dockerfile agree with the CLI: no Docker engine, no network.

Each node's command line is rebuilt the way Compose and `sh -c` would build it (Compose's
`$$` escape, the `$(diloco-node keygen ... --peer-id)` substitution run in-process against
temporary key files standing in for the named volumes, the shared run flags from the
environment), then parsed by the real CLI parser and validated by `JoinConfig` (the
dashboard's by `StandaloneConfig`, as `diloco-node dashboard` does). The mutation tests at
the end break a copy of the file in one way each and expect the same checks to fail.

The model of a Compose start is tests/unit/compose_swarm.py, the checks
tests/unit/compose_checks.py (moved out of this file unchanged in session 24).
"""

from __future__ import annotations

import copy
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

from node.config import JoinConfig
from tests.unit.compose_checks import (
    check_dashboard,
    check_dockerfile,
    check_keys_service,
    check_peers,
    check_ports,
    check_shared_run,
    check_storage,
    container_ports,
)
from tests.unit.compose_swarm import (
    BOOTSTRAP,
    COMPOSE_FILE,
    DASHBOARD,
    DOCKERFILE,
    DOCKERIGNORE,
    KEYS_SERVICE,
    NODES,
    REPO,
    TORCH_PIN,
    Swarm,
    load_compose,
    start_swarm,
)


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
