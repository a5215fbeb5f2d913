"""aligner: LLM alignment on Megatron-core (SFT, reward models, RL, preference optimisation)."""
from pathlib import Path

from aligner import megatron_jit

__version__ = "0.1.0"

# Hydra configs live at the repository root (`conf/`), next to this package.
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

megatron_jit.install()  # before any megatron import of this process (see megatron_jit.py)
