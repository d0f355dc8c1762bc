"""node.signals: the first signal asks for a clean stop, a second Ctrl+C aborts, and the
process's handlers are back as they were afterwards."""

from __future__ import annotations

import os
import signal

import pytest

from node.signals import FINISH_SIGNAL, STOP_SIGNALS, stop_on_signals


def test_the_first_signal_asks_to_stop_and_a_second_ctrl_c_aborts() -> None:
    asked: list[bool] = []
    with stop_on_signals(lambda: asked.append(True)):
        os.kill(os.getpid(), signal.SIGTERM)
        assert asked == [True]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert asked == [True]


def test_the_previous_handlers_are_restored() -> None:
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    with stop_on_signals(lambda: None):
        assert all(signal.getsignal(sig) is not before[sig] for sig in STOP_SIGNALS)
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before


def test_sigusr1_asks_to_finish_without_stopping_and_its_handler_is_restored() -> None:
    before = signal.getsignal(FINISH_SIGNAL)
    stopped: list[bool] = []
    finished: list[bool] = []
    with stop_on_signals(lambda: stopped.append(True), lambda: finished.append(True)):
        os.kill(os.getpid(), FINISH_SIGNAL)
        assert (stopped, finished) == ([], [True])
    assert signal.getsignal(FINISH_SIGNAL) == before
    with stop_on_signals(lambda: None):  # no finish asked for: SIGUSR1 is left alone
        assert signal.getsignal(FINISH_SIGNAL) == before
