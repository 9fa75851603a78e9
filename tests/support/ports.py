"""Free TCP ports on 127.0.0.1 for servers that are told their port and bind it later.

``bind(("127.0.0.1", 0))`` gives a port from the kernel's ephemeral range, the range every
client socket and every other ``bind(0)`` draws from too. A server handed such a port binds
it some time later (sshd within milliseconds, vLLM a minute or more after launch); in
between, anything else on the machine may be given the same port, and the server fails to
bind, or a test reaches the wrong server. :func:`unused_port` picks below the ephemeral
range instead, which the kernel never hands out on its own, in a slice of its own for each
pytest-xdist worker (and one for the controller), so that two workers never pick alike.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

__all__ = ["unused_port"]

HOST = "127.0.0.1"
LOWEST = 10_000
_random = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default
    return max(low, LOWEST + 1_000)


def _slice() -> range:
    """This process's share of the ports between LOWEST and the ephemeral range."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    # The controller (or a run without xdist) takes the slice after the workers'.
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else count
    width = (_ephemeral_low() - LOWEST) // (count + 1)
    start = LOWEST + index * width
    return range(start, start + width)


def unused_port() -> int:
    """A port of 127.0.0.1 that nothing listens on now and no ``bind(0)`` will be given."""
    ports = _slice()
    for _ in range(200):
        port = _random.choice(ports)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1} after 200 tries")
