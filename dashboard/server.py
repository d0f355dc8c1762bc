"""uvicorn in a background thread, on a socket this process binds itself (port 0 works)."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # uvicorn and fastapi load with the first server, beside the node's training
    from fastapi import FastAPI

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0


class DashboardServer:
    """Binds at construction, so a port in use is reported before anything else starts."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        import uvicorn  # not at import: a node starts its dashboard after its first step

        self._socket = bind(host, port)
        self.host = host
        self.port = int(self._socket.getsockname()[1])
        config = uvicorn.Config(
            app,
            log_config=None,  # the process's logging (stderr) as it is; stdout stays clean
            access_log=False,
            log_level="warning",  # not uvicorn's "Started/Finished server process" lines
            lifespan="off",
            timeout_graceful_shutdown=1,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="dashboard"
        )
        self._thread.daemon = True

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ipaddress.ip_address(self.host).version == 6 else self.host
        return f"http://{host}:{self.port}/"

    def start(self, timeout_s: float = START_TIMEOUT_S) -> str:
        """Serve in the background; the URL once requests are answered."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise OSError(f"the dashboard did not start on {self.url}")
            time.sleep(0.02)
        return self.url

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("the dashboard server did not stop within %s s", timeout_s)
        with contextlib.suppress(OSError):
            self._socket.close()


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on host:port; OSError saying which address is taken."""
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"the dashboard cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def check_free(host: str, port: int) -> None:
    """Raise OSError now if host:port cannot be bound (the server binds it later)."""
    bind(host, port).close()
