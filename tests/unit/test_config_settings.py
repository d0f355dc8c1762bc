"""`join`'s typed settings: each flag lands in its field whatever its section, a bad value is one
line naming its flag, and nothing but the command line sets a node's configuration."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
from pathlib import Path

import pydantic.dataclasses
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.cli import build_parser, main
from node.config import JoinConfig, add_config_arguments, config_from_args
from node.settings import FLAGS, SECTIONS

PARSER = build_parser()


def _join(*argv: str) -> JoinConfig:
    return config_from_args(JoinConfig, PARSER.parse_args(["join", *argv]))


def _error(*argv: str) -> str:
    with pytest.raises(ValueError) as caught:
        _join(*argv)
    return str(caught.value)


@settings(max_examples=20, deadline=None)
@given(
    inner_steps=st.integers(1, 10_000),
    outer_lr=st.floats(1e-6, 10.0),
    staleness=st.sampled_from(["constant", "polynomial", "hinge", "exponential"]),
    checkpoint_every=st.integers(1, 1000),
    heartbeat_period=st.floats(0.2, 3600.0),
    dashboard_port=st.integers(0, 65535),
    wandb=st.booleans(),
)
def test_every_section_takes_its_flags_by_their_old_names(
    inner_steps: int,
    outer_lr: float,
    staleness: str,
    checkpoint_every: int,
    heartbeat_period: float,
    dashboard_port: int,
    wandb: bool,
) -> None:
    config = _join(
        "--inner-steps", str(inner_steps), "--outer-lr", repr(outer_lr),
        "--staleness", staleness, "--checkpoint-every", str(checkpoint_every),
        "--heartbeat-period", repr(heartbeat_period), "--dashboard-port", str(dashboard_port),
        "--wandb" if wandb else "--no-wandb",
    )  # fmt: skip
    assert (config.inner_steps, config.outer_lr, config.staleness) == (
        inner_steps,
        outer_lr,
        staleness,
    )
    assert (config.checkpoint_every, config.heartbeat_period) == (
        checkpoint_every,
        heartbeat_period,
    )
    assert (config.dashboard_port, config.wandb) == (dashboard_port, wandb)


def test_unset_flags_keep_every_default() -> None:
    config, default = _join(), JoinConfig()
    for field in dataclasses.fields(JoinConfig):
        assert getattr(config, field.name) == getattr(default, field.name), field.name


def test_lists_and_switches_read_as_before() -> None:
    peer = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    config = _join("--peers", peer, peer, "--no-swarm", "--no-relay", "--client-mode")
    assert config.peers == [peer, peer]
    assert (config.swarm, config.relay, config.client_mode) == (False, False, True)


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--retain-updates", "-1"], "--retain-updates must be a positive integer, got -1"),
        (["--speed-factor", "0.5"], "--speed-factor must be between 1 and 1000, got 0.5"),
        (["--dashboard-port", "70000"], "--dashboard-port must be between 0 and 65535, got 70000"),
        (["--log-format", "xml"], "--log-format must be one of rich, json; got 'xml'"),
        (["--fragments", "8", "--inner-steps", "4"], "--fragments must be at most --inner-steps"),
        (["--run-id", ""], "--run-id must be 1 to 64 characters long"),
    ],
)
def test_a_bad_value_is_one_line_naming_its_flag(argv: list[str], line: str) -> None:
    error = _error(*argv)
    assert "\n" not in error
    assert error.startswith(line), error


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--inner-steps", "zero"], "argument --inner-steps: invalid int value: 'zero'"),
        (["--outer-lr", "nan"], "argument --outer-lr: invalid float value: 'nan'"),
        (["--max-time", "inf"], "argument --max-time: invalid float value: 'inf'"),
    ],
)
def test_a_word_for_a_number_exits_2_as_argparse_did(argv: list[str], line: str) -> None:
    error = io.StringIO()
    with pytest.raises(SystemExit) as exited, contextlib.redirect_stderr(error):
        main(["join", *argv])
    assert exited.value.code == 2
    assert error.getvalue() == f"diloco-node join: error: {line}\n"


@settings(max_examples=20, deadline=None)
@given(
    flag=st.sampled_from(["--inner-steps", "--outer-lr", "--codec", "--port", "--dashboard-port"]),
    text=st.text(min_size=1, max_size=12).filter(lambda s: not s.startswith("-")),
)
def test_any_text_is_a_value_or_one_line_naming_its_flag(flag: str, text: str) -> None:
    error = io.StringIO()
    try:
        with contextlib.redirect_stderr(error):
            config = _join(flag, text)
    except SystemExit:  # argparse: a word for a number
        message = error.getvalue().removesuffix("\n")
    except ValueError as exc:  # pydantic: a value out of range or choices
        message = str(exc)
    else:
        assert str(getattr(config, flag[2:].replace("-", "_"))) != ""
        return
    assert "\n" not in message and flag in message, message


def test_log_level_is_checked_in_any_case_and_kept_as_given() -> None:
    assert _join("--log-level", "debug").log_level == "debug"
    assert "--log-level must be one of" in _error("--log-level", "loud")


def test_the_environment_sets_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """pydantic-settings reads environment variables by default; a node's must not."""
    for section in SECTIONS:
        monkeypatch.setenv(section.upper(), '{"inner_steps": 7, "port": 9, "wandb": true}')
    monkeypatch.setenv("INNER_STEPS", "7")
    config = _join()
    assert (config.inner_steps, config.port, config.wandb) == (100, None, False)


def test_a_copy_keeps_the_token_read_from_its_file(tmp_path: Path) -> None:
    """compose() copies the config with another --identity when the default key is taken."""
    token_file = tmp_path / "token"
    token_file.write_text("from-a-file\n")
    token_file.chmod(0o600)
    config = _join("--dashboard-token-file", str(token_file))
    copy = dataclasses.replace(config, identity=str(tmp_path / "identity-1.key"))
    assert copy.dashboard_token == config.dashboard_token == "from-a-file"
    assert "not both" in _error(
        "--dashboard-token", "other", "--dashboard-token-file", str(token_file)
    )


@pydantic.dataclasses.dataclass(kw_only=True, config=FLAGS)
class _BenchConfig:
    """A flat config, as the benchmarks have."""

    nodes: int = 4
    """Nodes to start."""
    methods: str = "async"
    """Methods to run."""
    netns: bool = True
    """One network namespace per node."""

    def __post_init__(self) -> None:
        if self.nodes < 2:
            raise ValueError("--nodes must be at least 2")


def test_a_flat_config_parses_and_checks_itself() -> None:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, _BenchConfig)
    parser.add_argument("--plot", action="store_true")  # the parser's own flags stay its own
    args = parser.parse_args(["--nodes", "6", "--no-netns", "--plot"])
    assert config_from_args(_BenchConfig, args) == _BenchConfig(nodes=6, netns=False)
    assert args.plot
    assert "Nodes to start. [default: 4]" in parser.format_help()
    with pytest.raises(ValueError, match="^--nodes must be at least 2$"):
        config_from_args(_BenchConfig, parser.parse_args(["--nodes", "1"]))
