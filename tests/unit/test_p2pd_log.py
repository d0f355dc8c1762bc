"""DILOCO_P2PD_LOG: p2pd's lines of the named subsystems come out of the node's log."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from dht.p2pd_log import ENV, P2PD_LOGGER, forward_p2pd_log


@pytest.fixture
def p2pd_logger() -> Iterator[logging.Logger]:
    log = logging.getLogger(P2PD_LOGGER)
    saved = log.level, list(log.handlers)
    yield log
    log.setLevel(saved[0])
    log.handlers[:] = saved[1]


def test_unset_changes_nothing(p2pd_logger: logging.Logger) -> None:
    environ: dict[str, str] = {}
    handlers = list(p2pd_logger.handlers)
    assert not forward_p2pd_log(environ)
    assert environ == {} and p2pd_logger.handlers == handlers


def test_set_forwards_p2pd_lines_at_info_once(
    p2pd_logger: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    environ = {ENV: "p2p-holepunch=debug"}
    assert forward_p2pd_log(environ) and forward_p2pd_log(environ)
    assert environ["GOLOG_LOG_LEVEL"] == "error,p2p-holepunch=debug"
    with caplog.at_level(logging.INFO, logger="dht.p2pd_log"):
        p2pd_logger.debug("hole punch succeeded", extra={"caller": "holepunch/svc.go:1"})
    lines = [r.getMessage() for r in caplog.records if r.name == "dht.p2pd_log"]
    assert lines == ["p2pd holepunch/svc.go:1: hole punch succeeded"]  # one handler, not two


def test_a_golog_level_already_set_wins(p2pd_logger: logging.Logger) -> None:
    environ = {ENV: "p2p-holepunch=debug", "GOLOG_LOG_LEVEL": "info"}
    assert forward_p2pd_log(environ)
    assert environ["GOLOG_LOG_LEVEL"] == "info"
