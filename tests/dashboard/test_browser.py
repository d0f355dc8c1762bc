"""End to end in a real browser: two nodes, a standalone dashboard, Debian's headless chromium.

Needs /usr/bin/chromium and /usr/bin/chromedriver (.ci/run installs both with apt-get); selenium
is told where the driver is, so it never downloads one. The screenshot is kept in
tests/artifacts/dashboard.png.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.procs import node_process
from tests.conftest import REPO
from tests.swarm.conftest import NodeProcess, _reap_all

pytestmark = [pytest.mark.swarm, pytest.mark.beside]  # no timing window: beside the swarm tests

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ARTIFACTS = REPO / "tests" / "artifacts"
RUN = ["--model", "tiny", "--threads", "1", "--inner-steps", "10", "--eval-batches", "2",
       "--heartbeat-period", "1"]  # fmt: skip
START_S = 120  # bounded waits, generous for a loaded 2-core machine
PAGE_S = 90
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run",
                  "--window-size=1440,1250"]  # fmt: skip
Launch = Callable[..., NodeProcess]


DASHBOARD_COMMAND = ["dashboard", "--log-format", "json", "--port", "0"]


@pytest.fixture
def dashboard_process(tmp_path: Path) -> Iterator[Callable[..., NodeProcess]]:
    started: list[NodeProcess] = []

    def _start(*args: str) -> NodeProcess:
        home = tmp_path / "homes" / "dashboard"
        process = node_process("dashboard", *args, home=home, command=DASHBOARD_COMMAND)
        started.append(process)
        return process.start()

    try:
        yield _start
    finally:
        _reap_all(started)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium: apt-get install chromium chromium-driver")
    if not CHROMEDRIVER.exists():
        pytest.skip("no /usr/bin/chromedriver: apt-get install chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = str(CHROMIUM)
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}"]:
        options.add_argument(flag)
    service = Service(str(CHROMEDRIVER), log_output=str(tmp_path / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def page_state(driver: Any) -> dict[str, Any]:
    """What a person sees: the alive count, the loss chart's points, each peer row's state."""
    return driver.execute_script(  # type: ignore[no-any-return]
        """
        const rows = [...document.querySelectorAll('#peers tbody tr[data-peer-id]')];
        return {
          alive: document.getElementById('peers-alive').textContent,
          lossPoints: document.querySelectorAll('#loss-chart circle.point').length,
          lossPeers: document.querySelectorAll('#loss-legend span[title]').length,
          peers: Object.fromEntries(rows.map(r => [r.dataset.peerId,
            {cls: r.className, state: r.querySelector('.badge').textContent}])),
          codecs: Object.fromEntries(rows.map(r => [r.dataset.peerId,
            r.querySelector('td.codec').textContent])),
          connection: document.getElementById('connection').className,
        };
        """
    )


def wait_for_page(driver: Any, predicate: Callable[[dict[str, Any]], bool], what: str) -> None:
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        WebDriverWait(driver, PAGE_S, poll_frequency=0.5).until(lambda d: predicate(page_state(d)))
    except TimeoutException:
        save_screenshot(driver, "dashboard-failure.png")
        raise AssertionError(f"page never showed {what}: {page_state(driver)}") from None


def save_screenshot(driver: Any, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    driver.save_screenshot(str(path))
    return path


def test_page_shows_two_live_peers_learning_then_one_dead(
    launch: Launch, dashboard_process: Callable[..., NodeProcess], browser: Any
) -> None:
    first = launch(*RUN, "--org", "alpha", name="node0")
    maddr = first.wait_listening(START_S)[0]
    second = launch(*RUN, "--org", "beta", "--peers", maddr, name="node1")
    dashboard = dashboard_process("--peers", maddr)
    url = dashboard.wait_for_event("dashboard", START_S)["url"]
    second.wait_listening(START_S)

    browser.get(url)
    ids = {first.peer_id, second.peer_id}
    wait_for_page(
        browser,
        lambda s: (
            s["alive"] == "2"
            and set(s["peers"]) == ids
            and s["lossPoints"] >= 2
            and s["lossPeers"] == 2
            and all(re.match(r"(bf16|int8|int4|topk) \(auto\) · ", c) for c in s["codecs"].values())
        ),
        "2 alive peers, a loss chart with points of both, and the codec each sends with",
    )

    second.kill()
    wait_for_page(
        browser,
        lambda s: (
            s["alive"] == "1"
            and s["peers"].get(second.peer_id) == {"cls": "dead", "state": "dead"}
            and s["peers"].get(first.peer_id, {}).get("cls") == "alive"
        ),
        f"{second.name} marked dead",
    )
    assert "live" in page_state(browser)["connection"]
    assert save_screenshot(browser, "dashboard.png").stat().st_size > 10_000

    assert dashboard.stop() == 0, dashboard.stderr_tail()  # Ctrl+C: a clean exit
    assert dashboard.leftover_processes() == [], "its DHT process and p2pd must not outlive it"


def serve(observer: Any) -> tuple[Any, str]:
    """A standalone dashboard over the fake DHT (signed heartbeats as the DHT hands them out),
    served on a free port: the server (stop it) and its URL."""
    from dashboard.app import create_app
    from dashboard.history import History
    from dashboard.server import DashboardServer
    from dashboard.settings import DashboardSettings
    from dashboard.standalone import StandaloneSource

    settings = DashboardSettings(port=0)
    source = StandaloneSource(observer, "run", settings, History(settings))
    server = DashboardServer(create_app(source, settings), "127.0.0.1", 0)
    return server, server.start()


def test_page_shows_who_refused_whom_and_why(browser: Any) -> None:
    """Two peers report what they refused from a third (signed heartbeats, as the DHT hands
    them out): the page sums them per offender and reason and names both reporters."""
    import time

    from dht.heartbeat import Heartbeat
    from merge.identity import Identity
    from tests.dashboard.conftest import FakeObserver

    alice, bob, mallory = Identity.generate(), Identity.generate(), Identity.generate()
    observer = FakeObserver()
    refused = {
        alice: {"bad_signature": 5, "notify_rate": 20},
        bob: {"bad_signature": 2},
    }
    for identity, reasons in refused.items():
        beat = Heartbeat(
            peer_id=identity.peer_id,
            sent_at=time.time(),
            heartbeat_period_s=60.0,
            rejections=reasons,
            rejected_peers={mallory.peer_id: reasons},
        )
        observer.publish(beat, identity)
    server, url = serve(observer)
    try:
        browser.get(url)
        from selenium.webdriver.support.ui import WebDriverWait

        def rows(driver: Any) -> Any:
            return driver.execute_script(
                """
                return [...document.querySelectorAll('#rejections tbody tr[data-offender]')]
                  .map(r => ({offender: r.dataset.offender,
                    total: r.children[1].textContent,
                    reasons: Object.fromEntries([...r.querySelectorAll('.reason')]
                      .map(s => [s.dataset.reason, Number(s.dataset.count)])),
                    reporters: [...r.children[3].querySelectorAll('code')].map(c => c.title)}));
                """
            )

        WebDriverWait(browser, PAGE_S, poll_frequency=0.5).until(lambda d: rows(d))
        (row,) = rows(browser)
        assert row["offender"] == mallory.peer_id and row["total"] == "27"
        assert row["reasons"] == {"notify_rate": 20, "bad_signature": 7}
        assert sorted(row["reporters"]) == sorted([alice.peer_id, bob.peer_id])
        save_screenshot(browser, "dashboard-rejections.png")
    finally:
        server.stop()


def test_page_pages_through_the_peers_with_the_swarm_summary_above(browser: Any) -> None:
    """120 signed peers behind the fake DHT: the page holds 50 rows at a time, its totals and
    summary count all 120, and next / prev turn the page (issue 22, item 5)."""
    import time

    from selenium.webdriver.support.ui import WebDriverWait

    from dht.heartbeat import Heartbeat
    from merge.identity import Identity
    from tests.dashboard.conftest import FakeObserver

    observer = FakeObserver()
    for i in range(120):
        identity = Identity.generate()
        beat = Heartbeat(
            peer_id=identity.peer_id, sent_at=time.time(), heartbeat_period_s=60.0, loss=i / 10
        )
        observer.publish(beat, identity)
    server, url = serve(observer)

    def shown(driver: Any) -> Any:
        return driver.execute_script(
            """
            return {label: document.getElementById('page-label').textContent,
              rows: [...document.querySelectorAll('#peers tbody tr[data-peer-id]')]
                .map(r => r.dataset.peerId),
              alive: document.getElementById('peers-alive').textContent,
              spread: document.getElementById('loss-spread-sub').textContent,
              next: !document.getElementById('page-next').disabled,
              download: document.getElementById('download').getClientRects().length};
            """
        )

    try:
        browser.get(url)
        wait = WebDriverWait(browser, PAGE_S, poll_frequency=0.2)
        wait.until(lambda d: shown(d)["label"].startswith("peers 1–50 of 120"))
        first = shown(browser)
        assert first["alive"] == "120" and len(first["rows"]) == 50 and first["next"]
        assert first["download"] == 0  # no state download: its bar takes no room
        assert "p10 1.200 · p90 10.700" in first["spread"]
        browser.find_element("id", "page-next").click()
        browser.find_element("id", "page-next").click()  # the last page: 20 rows
        wait.until(lambda d: shown(d)["label"].endswith("page 3 / 3"))
        last = shown(browser)
        assert len(last["rows"]) == 20 and not last["next"]
        browser.find_element("id", "page-prev").click()
        wait.until(lambda d: shown(d)["label"].startswith("peers 51–100"))
        middle = shown(browser)["rows"]
        assert len({*first["rows"], *middle, *last["rows"]}) == 120
        browser.execute_script("window.scrollTo(0, 0)")
        save_screenshot(browser, "dashboard-pages.png")
    finally:
        server.stop()


def test_page_shows_updates_lost_and_waiting_for_a_state(browser: Any) -> None:
    """A peer that waits for a state to bring 85 updates (session 22: not lost) and one of the
    last release: the tile sums them over live peers, each row shows its own."""
    import time

    from selenium.webdriver.support.ui import WebDriverWait

    from dht.heartbeat import Heartbeat
    from merge.identity import Identity
    from tests.dashboard.conftest import FakeObserver

    waiting, old = Identity.generate(), Identity.generate()
    observer = FakeObserver()
    for identity, counts in ((waiting, {"num_lost": 3, "num_need_state": 85}), (old, {})):
        beat = Heartbeat(
            peer_id=identity.peer_id, sent_at=time.time(), heartbeat_period_s=60.0, **counts
        )
        observer.publish(beat, identity)
    server, url = serve(observer)

    def shown(driver: Any) -> Any:
        return driver.execute_script(
            """
            return {lost: document.getElementById('updates-lost').textContent,
              sub: document.getElementById('updates-lost-sub').textContent,
              rows: Object.fromEntries(
                [...document.querySelectorAll('#peers tbody tr[data-peer-id]')]
                  .map(r => [r.dataset.peerId, r.querySelector('td.lost').textContent]))};
            """
        )

    try:
        browser.get(url)
        WebDriverWait(browser, PAGE_S, poll_frequency=0.2).until(lambda d: shown(d)["rows"])
        page = shown(browser)
        assert page["lost"] == "3" and page["sub"].startswith("85 waiting for a state · 1 peer")
        assert page["rows"] == {waiting.peer_id: "3 +85", old.peer_id: "0"}
    finally:
        server.stop()
