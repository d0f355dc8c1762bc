"""hivemind's import leaves scipy.optimize unrun until something uses it (dht.lazy_scipy): a
node's start no longer pays ~1 s for the averager's load balancer, which it never calls."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPT = """
import inspect, sys, threading
import dht.swarm, dashboard.app, hivemind
inspect.getmodule(sys._getframe())  # reads __file__ of every module, as pydantic does
print("scipy.linalg" in sys.modules, "scipy.optimize._optimize" in sys.modules)
import scipy
import scipy.optimize
seen = []
def use(): seen.append(callable(scipy.optimize.linprog))
threads = [threading.Thread(target=use) for _ in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
print(seen.count(True), scipy.optimize is sys.modules["scipy.optimize"] is scipy.optimize)
from hivemind.averaging.load_balancing import load_balance_peers
print(*load_balance_peers(100, (1.0, 2.0, None)))
from scipy.optimize import linprog
print(linprog([1, 1], A_ub=[[-1, -1]], b_ub=[-1]).fun)
"""


@pytest.fixture(scope="module")
def printed() -> list[str]:
    """SCRIPT's lines, in a fresh interpreter (imports are process-wide; ~2-3 s)."""
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_the_network_layer_imports_hivemind_without_running_scipy_optimize(
    printed: list[str],
) -> None:
    """Nor does inspect.getmodule, which reads `__file__` of every module in sys.modules
    (pydantic calls it for each settings dataclass; importlib's LazyLoader loaded on it)."""
    assert printed[0] == "False False"


def test_threads_that_use_it_at_once_all_see_it_whole_and_it_is_one_module(
    printed: list[str],
) -> None:
    assert printed[1] == "8 True"


def test_scipy_optimize_works_as_imported_once_used(printed: list[str]) -> None:
    """The load balancer hivemind's averager would call, and linprog itself."""
    assert printed[2:] == ["0 69 31", "1.0"]
