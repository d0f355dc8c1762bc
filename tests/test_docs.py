"""The documentation a user reads holds: the README is a newcomer's page whose commands are
the ones CI runs and whose links resolve, and the docs site builds strict and offline."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from markdown.extensions.toc import slugify

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
MAIN_JOB = "pip install torch==2.13.0 -e . && diloco-node join"
SUBCOMMANDS = ("join", "status", "dashboard", "keygen", "export")
FLAG = re.compile(r"(?<!\S)--[a-z][a-z0-9-]*")

# Runs mkdocs with every outgoing connection and name lookup refused and reported, so a
# theme or plugin that fetches anything at build time fails the test even if it swallows
# the error.
NO_NETWORK_MKDOCS = """
import socket, sys

def refuse(*args, **kwargs):
    print(f"NETWORK ATTEMPT {args!r}", file=sys.stderr)
    raise OSError("network access during the docs build")

socket.socket.connect = refuse
socket.socket.connect_ex = refuse
socket.create_connection = refuse
socket.getaddrinfo = refuse
from mkdocs.__main__ import cli
sys.exit(cli())
"""

# Prints `diloco-node NAME --help` for each NAME given, through the console script's entry
# point, in one process (the CLI imports torch: one import, not five).
HELP_SEPARATOR = "\n=== next subcommand ===\n"
ALL_HELP = f"""
import sys
from node.entry import main

for position, name in enumerate(sys.argv[1:]):
    if position:
        print({HELP_SEPARATOR!r}, end="")
    sys.argv = ["diloco-node", name, "--help"]
    try:
        main()
    except SystemExit as stop:
        if stop.code:
            raise
    sys.stdout.flush()
"""

# A built page that loads something from another host does not work offline.
REMOTE_ASSET = re.compile(
    r"<(?:script|img|iframe)\b[^>]*\bsrc=\"(?:https?:)?//"
    r"|<link\b[^>]*\brel=\"(?:stylesheet|preconnect|preload|icon)\"[^>]*\bhref=\"(?:https?:)?//"
    r"|@import\s+url\((?:https?:)?//"
)


def _bash_lines(text: str) -> Iterator[str]:
    for block in re.findall(r"^[ \t]*```bash\n(.*?)^[ \t]*```", text, re.S | re.M):
        yield from (line.strip() for line in block.splitlines())


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _headings(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    headings = {slugify(h, "-") for h in re.findall(r"^#{1,6} (.+?)\s*$", text, re.M)}
    return headings | set(re.findall(r'<a id="([^"]+)"></a>', text))


def _nav_pages(nav: list[object]) -> Iterator[str]:
    for entry in nav:
        values = entry.values() if isinstance(entry, dict) else [entry]
        for value in values:
            if isinstance(value, list):
                yield from _nav_pages(value)
            else:
                yield str(value)


def test_the_docs_site_builds_strict_without_the_network(tmp_path: Path) -> None:
    site = tmp_path / "site"
    command = [sys.executable, "-c", NO_NETWORK_MKDOCS, "build", "--strict"]
    command += ["--config-file", str(REPO / "mkdocs.yml"), "--site-dir", str(site)]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
    output = built.stdout + built.stderr
    assert built.returncode == 0, output
    assert "NETWORK ATTEMPT" not in output
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    for page in _nav_pages(nav):
        built_page = site / ("index.html" if page == "index.md" else f"{page[:-3]}/index.html")
        assert built_page.is_file(), f"{page} is in the nav but was not built"
    remote = [str(p) for p in site.rglob("*.html") if REMOTE_ASSET.search(p.read_text())]
    assert not remote, f"pages that load assets from the network: {remote}"


@pytest.mark.parametrize("page", [README, DOCS / "index.md"], ids=["README.md", "docs/index.md"])
def test_ci_runs_the_test_command_shown_and_the_main_job_is_shown(page: Path) -> None:
    commands = list(_bash_lines(page.read_text()))
    ci_lines = (REPO / ".ci" / "run").read_text().splitlines()
    ci_tests = [line.strip() for line in ci_lines if "pytest" in line and "#" not in line]
    assert ci_tests, ".ci/run runs no pytest"
    for ci in ci_tests:
        assert ci in commands, f".ci/run runs {ci!r}, which {page.name} does not show"
    assert MAIN_JOB in commands


def test_the_readme_is_a_page_a_newcomer_reads_to_the_end() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    for section in ("Quick start", "Joining a swarm", "Dashboard", "Trust", "Several GPUs"):
        assert f"\n## {section}" in text, f"the README lost its {section!r} section"
    assert "## Which package does what" in text


def _table_rows(text: str, heading: str) -> list[str]:
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("|")]


@pytest.mark.parametrize("heading", ["Layout", "Which package does what"])
def test_the_site_shows_the_readmes_layout_and_packages(heading: str) -> None:
    readme = _table_rows(README.read_text(), heading)
    assert len(readme) > 2
    assert readme == _table_rows((DOCS / "layout.md").read_text(), heading)


@pytest.mark.parametrize("page", _markdown_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_point_at_files_and_headings_that_exist(page: Path) -> None:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name} links to {target}, which does not exist"
        if anchor and linked.suffix == ".md":
            assert anchor in _headings(linked), f"{page.name}: no heading #{anchor} in {path}"


def test_the_command_lines_in_the_docs_use_flags_the_cli_has() -> None:
    used: dict[str, set[str]] = {name: set() for name in SUBCOMMANDS}
    for page in _markdown_files():
        for line in _bash_lines(page.read_text()):
            if match := re.match(r"diloco-node (\w+)(.*?)(?:#.*)?$", line):
                used[match.group(1)] |= set(FLAG.findall(match.group(2)))
    wanted = [name for name in SUBCOMMANDS if used[name]]
    env = {**os.environ, "COLUMNS": "200"}
    command = [sys.executable, "-c", ALL_HELP, *wanted]
    helps = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
    assert helps.returncode == 0, helps.stderr
    for name, text in zip(wanted, helps.stdout.split(HELP_SEPARATOR), strict=True):
        unknown = sorted(flag for flag in used[name] if not re.search(rf"{flag}(?![\w-])", text))
        assert not unknown, f"the docs show `diloco-node {name}` with flags it lacks: {unknown}"


def test_the_docs_extra_is_installed_by_the_test_extra() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert set(extras["docs"]) <= set(extras["test"])
