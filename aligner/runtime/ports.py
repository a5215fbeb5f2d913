"""Free TCP ports for the launcher's rendezvous, without importing torch (the CLI process launches ranks)."""
from __future__ import annotations

import random
import socket


# not the `random` module's generator, which a run seeds (seeding.seed_everything): two runs of one seed on a host
# would draw the same ports (two rollout-worker bridges collided on 20572 so)
_DRAWS = random.SystemRandom()


def free_port(low: int = 20000, high: int = 32000) -> int:
    """A free TCP port below Linux's ephemeral range (32768+), so that no other process's
    `bind(0)` or outgoing connection can take it between now and our rank 0 binding it."""
    for _ in range(200):
        port = _DRAWS.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in [{low}, {high})")
