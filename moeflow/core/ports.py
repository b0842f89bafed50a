"""A free TCP port on 127.0.0.1: the one helper servers, process groups, benchmarks and
tests ask (free when this returns; the caller binds it a moment later)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (servers, torch.distributed rendezvous, tests,
    `moeflow serve --port 0`)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
