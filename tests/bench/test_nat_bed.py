"""The NAT bed: real NATs (a home reaches the internet, the internet cannot reach a home; the
cone NAT keeps source ports, the symmetric one does not), tbf lines, and no namespace left
behind, even after kill -9 of the process that built it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from bench.nat import NatLab, missing, namespaces
from tests.conftest import REPO

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))
SERVER_PORT = 7000
SOURCE_PORT = 4444
GONE_S = 20.0


def connect_from(lab: NatLab, namespace: str, host: str, port: int, timeout_s: float = 3.0) -> str:
    """Connect from `namespace` with source port SOURCE_PORT; 'ok' or the error's name."""
    code = (
        "import socket, sys\ns = socket.socket()\ns.settimeout(float(sys.argv[1]))\n"
        "s.bind(('0.0.0.0', int(sys.argv[2])))\n"
        "try:\n    s.connect((sys.argv[3], int(sys.argv[4]))); print('ok')\n"
        "except OSError as e:\n    print(type(e).__name__)"
    )
    args = [str(timeout_s), str(SOURCE_PORT), host, str(port)]
    out = subprocess.run([*lab.prefix(namespace), sys.executable, "-c", code, *args],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    return out.stdout.strip()


def observed_source(lab: NatLab, home: int) -> tuple[str, int]:
    """(address, port) the public machine sees a connection from `home` come from."""
    code = (
        "import socket, sys\ns = socket.create_server(('0.0.0.0', int(sys.argv[1])))\n"
        "s.settimeout(20)\nc, a = s.accept()\nprint(a[0], a[1])"
    )
    server = subprocess.Popen([*lab.prefix(lab.public(0)), sys.executable, "-c", code,
                               str(SERVER_PORT)], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while connect_from(lab, lab.host(home), lab.public_address(0), SERVER_PORT) != "ok":
            assert time.monotonic() < deadline, "the home never reached the public machine"
            time.sleep(0.2)
        out, _ = server.communicate(timeout=20)
    finally:
        server.kill()
        server.wait()
    address, port = out.split()
    return address, int(port)


def test_homes_reach_out_through_their_nat_and_nobody_reaches_in() -> None:
    with NatLab(down_mbit=None, up_mbit=None) as lab:
        assert observed_source(lab, 0) == (lab.router_address(0), SOURCE_PORT)  # cone
        address, port = observed_source(lab, 1)  # symmetric: a random port
        assert address == lab.router_address(1) and port != SOURCE_PORT
        code = (
            "import socket, sys\ns = socket.create_server(('0.0.0.0', int(sys.argv[1])))\n"
            "while True:\n    s.accept()[0].close()"
        )
        listener = subprocess.Popen([*lab.prefix(lab.host(0)), sys.executable, "-c", code,
                                     str(SERVER_PORT)])  # fmt: skip
        try:
            deadline = time.monotonic() + 10  # the LAN side (the router) reaches it ...
            while connect_from(lab, lab.router(0), lab.host_address(0), SERVER_PORT) != "ok":
                assert time.monotonic() < deadline, "the home's listener never came up"
                time.sleep(0.2)
            # ... the internet does not, neither at the home's address nor at its router's
            for target in (lab.host_address(0), lab.router_address(0)):
                outcome = connect_from(lab, lab.public(0), target, SERVER_PORT, timeout_s=1.0)
                assert outcome in ("TimeoutError", "OSError"), outcome
        finally:
            listener.kill()
            listener.wait()


def test_a_home_line_is_asymmetric() -> None:
    with NatLab(down_mbit=20, up_mbit=5) as lab:
        up = subprocess.run(["tc", "-n", lab.router(0), "qdisc", "show", "dev", "wan"],
                            capture_output=True, text=True, timeout=10).stdout  # fmt: skip
        down = subprocess.run(["tc", "-n", lab.wan, "qdisc", "show", "dev", "r0"],
                              capture_output=True, text=True, timeout=10).stdout  # fmt: skip
        assert "rate 5Mbit" in up and "rate 20Mbit" in down


def test_the_bed_is_torn_down_after_kill_9_of_its_builder() -> None:
    code = "from bench.nat import NatLab\nlab = NatLab().__enter__()\nprint(lab.tag, flush=True)\n"
    code += "import time\ntime.sleep(600)\n"
    builder = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    try:
        assert builder.stdout is not None
        tag = builder.stdout.readline().strip()
        assert len(namespaces(tag)) == 6, namespaces(tag)
        os.kill(builder.pid, signal.SIGKILL)
    finally:
        builder.kill()
        builder.wait()
    deadline = time.monotonic() + GONE_S
    while namespaces(tag):
        assert time.monotonic() < deadline, f"left behind: {namespaces(tag)}"
        time.sleep(0.2)
