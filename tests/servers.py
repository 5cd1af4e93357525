"""Helpers for tests that start real servers on loopback: a free port, a bounded wait for health."""
from __future__ import annotations

import contextlib
import socket
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, alive=lambda: True, timeout: float = 60) -> None:
    """Until GET {url}/health answers 200; AssertionError once `alive()` is false, TimeoutError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert alive(), "the server exited"
        with contextlib.suppress(OSError):
            if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become healthy")
