"""A newcomer whose bootstrap's DHT did not answer its first ping dials it again, for a bound
(dht.bootstrap_newcomer): it used to exit at once ("DHTNode bootstrap failed")."""

from __future__ import annotations

import asyncio

import pytest

from dht.bootstrap_newcomer import DhtBootstrapError, await_first_peer
from dht.swarm_config import SwarmError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds


class Bootstrap:
    """A rejoiner whose dials reach the bootstrap's DHT from the `answers_at`-th on."""

    def __init__(self, answers_at: int | None) -> None:
        self.peers = ["/ip4/127.0.0.1/tcp/1/p2p/12D3KooWBoot"]
        self.answers_at = answers_at
        self.num_dials = 0

    async def tick(self) -> None:
        self.num_dials += 1

    async def table_size(self) -> int:
        return int(self.answers_at is not None and self.num_dials >= self.answers_at)


def wait(bootstrap: Bootstrap, clock: Clock, wait_s: float = 45.0) -> float:
    return asyncio.run(
        await_first_peer(
            bootstrap, bootstrap.table_size, wait_s=wait_s, clock=clock, sleep=clock.sleep
        )
    )


def test_a_bootstrap_that_answered_at_once_costs_nothing() -> None:
    bootstrap = Bootstrap(answers_at=0)
    assert wait(bootstrap, Clock()) == 0.0
    assert bootstrap.num_dials == 0


def test_a_slow_bootstrap_is_dialled_again_until_it_answers() -> None:
    bootstrap, clock = Bootstrap(answers_at=5), Clock()
    assert wait(bootstrap, clock) == 4.0
    assert bootstrap.num_dials == 5


def test_a_bootstrap_that_never_answers_ends_the_newcomer_within_the_bound() -> None:
    bootstrap, clock = Bootstrap(answers_at=None), Clock()
    with pytest.raises(DhtBootstrapError, match="within 45 s") as raised:
        wait(bootstrap, clock)
    assert isinstance(raised.value, SwarmError)  # the CLI's one-sentence exit
    assert clock.now == 45.0 and bootstrap.num_dials == 45
