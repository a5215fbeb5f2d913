"""Free TCP ports for the launcher's rendezvous, without importing torch (the CLI process launches ranks)."""
from __future__ import annotations

import random
import socket


def free_port(low: int = 20000, high: int = 32000) -> int:
    """A free TCP port below Linux's ephemeral range (32768+), so that no other process's
    `bind(0)` or outgoing connection can take it between now and our rank 0 binding it."""
    for _ in range(200):
        port = random.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in [{low}, {high})")
