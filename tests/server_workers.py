"""Helpers for the server tests and the reward-server benchmark: free port blocks, small reward
checkpoints, leftover accounting."""
from __future__ import annotations

import glob
import random
import socket
from pathlib import Path

HOST = "127.0.0.1"


def free_port_block(n: int = 3, low: int = 20000, high: int = 32000) -> int:
    """A base port p with p..p+n-1 free on 127.0.0.1, below the ephemeral range (so no outgoing
    connection takes one before the server binds it)."""
    for _ in range(500):
        base = random.randrange(low, high - n)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind((HOST, port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free block of ports")


def make_reward_checkpoint(out, tokenizer_dir, num_outputs: int = 1, seed: int = 0, attributes=None, **model) -> Path:
    """A randomly initialised tiny reward model (the servers' tests compare scores, not quality)."""
    from omegaconf import OmegaConf

    from aligner.config.schema import ModelConfig
    from aligner.data.tokenizer import load_tokenizer
    from aligner.models import checkpoint
    from aligner.models.gpt import build_gpt
    from aligner.models.heads import attach_scalar_head
    from aligner.models.hf_convert import single_process
    from aligner.runtime.seeding import seed_everything

    tokenizer = load_tokenizer(tokenizer_dir)
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), model)
    with single_process():
        seed_everything(seed)
        rm = attach_scalar_head(build_gpt(cfg, len(tokenizer)), num_outputs)
        checkpoint.save_checkpoint(out, rm, cfg, len(tokenizer), head="reward", tokenizer=tokenizer,
                                   extra_meta={"scalar_head": {"num_outputs": num_outputs, "attributes": attributes,
                                                               "loss": "bt" if num_outputs == 1 else "regression"}})
    return Path(out)


def triton_scratch_dirs() -> set[str]:
    """Workspaces our servers create (removed on a clean exit)."""
    return set(glob.glob("/tmp/aligner-triton-*")) | set(glob.glob(str(Path.home() / ".cache/pytriton/workspace_*")))
