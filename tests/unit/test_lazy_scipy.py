"""hivemind's import leaves scipy.optimize unrun until something uses it (dht.lazy_scipy): a
node's start no longer pays ~1 s for the averager's load balancer, which it never calls."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def run(script: str) -> list[str]:
    """`script` in a fresh interpreter (imports are process-wide); its printed lines."""
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_the_network_layer_imports_hivemind_without_running_scipy_optimize() -> None:
    """inspect.getmodule reads `__file__` of every module (pydantic does it for each settings
    dataclass): that must not run the module either."""
    lines = run(
        "import sys, inspect, dht.swarm, dashboard.app, hivemind\n"
        "inspect.getmodule(sys._getframe())\n"
        "print('scipy.linalg' in sys.modules, 'scipy.optimize._optimize' in sys.modules)"
    )
    assert lines == ["False", "False"]


def test_scipy_optimize_works_as_imported_once_used() -> None:
    """The load balancer hivemind's averager would call, and the module is one object."""
    lines = run(
        "import sys, dht, hivemind\n"
        "from hivemind.averaging.load_balancing import load_balance_peers\n"
        "import scipy, scipy.optimize\n"
        "print(*load_balance_peers(100, (1.0, 2.0, None)))\n"
        "print(scipy.optimize is sys.modules['scipy.optimize'] is scipy.optimize)\n"
        "from scipy.optimize import linprog\n"
        "print(linprog([1, 1], A_ub=[[-1, -1]], b_ub=[-1]).fun)"
    )
    assert lines == ["0", "69", "31", "True", "1.0"]


def test_threads_that_use_it_at_once_see_it_whole() -> None:
    lines = run(
        "import dht, scipy.optimize, threading\n"
        "seen = []\n"
        "def use(): seen.append(callable(scipy.optimize.linprog))\n"
        "threads = [threading.Thread(target=use) for _ in range(8)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "print(seen.count(True))"
    )
    assert lines == ["8"]
