"""A progress bar with ETA for long commands, on the logging rank only."""
from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    """tqdm bar on stderr with ETA; silent when disabled."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.bar = None
        if enabled:
            self.bar = tqdm(total=total, initial=initial, unit="step", file=sys.stderr, dynamic_ncols=True)

    def update(self, metrics: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix({k: f"{metrics[k]:.4g}" for k in ("loss", "lr") if k in metrics}, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
