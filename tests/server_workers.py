"""Helpers for the server tests and the reward-server benchmark: free port blocks, small reward
checkpoints (also for the reward-model tests), leftover accounting."""
from __future__ import annotations

import glob
from pathlib import Path

from aligner.servers.process import free_port_block

__all__ = ["free_port_block", "make_reward_checkpoint", "triton_model_dirs", "triton_scratch_dirs"]


def make_reward_checkpoint(out, tokenizer_dir, num_outputs: int = 1, seed: int = 0, attributes=None,
                           head_scale: list[float] | None = None, **model) -> Path:
    """A randomly initialised tiny reward model (the servers' tests compare scores, not quality);
    `head_scale`: one factor per output, multiplying its row of the head (to spread the scores)."""
    import torch
    from omegaconf import OmegaConf

    from aligner.config.schema import ModelConfig
    from aligner.data.tokenizer import load_tokenizer
    from aligner.models import checkpoint
    from aligner.models.gpt import build_gpt
    from aligner.models.heads import attach_scalar_head
    from aligner.launch.ranks import single_process
    from aligner.runtime.seeding import seed_everything

    tokenizer = load_tokenizer(tokenizer_dir)
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), model)
    with single_process():
        seed_everything(seed)
        rm = attach_scalar_head(build_gpt(cfg, len(tokenizer)), num_outputs)
        if head_scale is not None:
            with torch.no_grad():
                rm.output_layer.weight.mul_(torch.tensor(head_scale)[:, None])
        checkpoint.save_checkpoint(out, rm, cfg, len(tokenizer), head="reward", tokenizer=tokenizer,
                                   extra_meta={"scalar_head": {"num_outputs": num_outputs, "attributes": attributes,
                                                               "loss": "bt" if num_outputs == 1 else "regression"}})
    return Path(out)


def triton_scratch_dirs() -> set[str]:
    """Workspaces our servers create (removed on a clean exit)."""
    return set(glob.glob("/tmp/aligner-triton-*")) | set(glob.glob(str(Path.home() / ".cache/pytriton/workspace_*")))


MODELS = ("reward_model", "critic_infer", "critic_train", "critic_save", "critic_load", "verifier")


def triton_model_dirs() -> set[str]:
    """The per-model directories tritonserver's Python backend makes in /tmp, and its python_env
    directories: a server killed with SIGKILL leaves them behind (notes/pytriton.md, F5)."""
    found = set(glob.glob("/tmp/python_env_??????"))
    for folder in glob.glob("/tmp/folder??????"):
        config = Path(folder) / "config.pbtxt"
        if config.exists() and any(f'name: "{m}"' in config.read_text(errors="replace") for m in MODELS):
            found.add(folder)
    return found


def forward_rows_rank(argv) -> None:
    """One rank of a (TP, PP, DP) server job scoring `sequences` with `forward_rows` (rewards at the
    last token and per-token values), as the servers do; rank 0 saves them. argv = [checkpoint, tp,
    pp, json sequences, out.pt]."""
    import json
    from types import SimpleNamespace

    import torch

    from aligner.models.checkpoint import load_weights, scalar_head_outputs
    from aligner.models.heads import last_token_scores
    from aligner.models.scoring import build_scalar_model, forward_rows, token_values_head
    from aligner.runtime import distributed
    from aligner.runtime.seeding import seed_everything
    from aligner.servers.protocol import pad_token_rows

    checkpoint, tp, pp, sequences, out = argv[0], int(argv[1]), int(argv[2]), json.loads(argv[3]), argv[4]
    distributed.init_process_group()
    distributed.init_model_parallel(tp, pp)
    seed_everything(0)
    outputs = scalar_head_outputs(checkpoint)
    parallel = SimpleNamespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, params_dtype=None)
    model, _, _ = build_scalar_model(checkpoint, parallel, outputs)
    load_weights(checkpoint, model)
    model.eval()
    tokens, lengths = (torch.from_numpy(a) for a in pad_token_rows(sequences))
    lengths = lengths[:, 0]
    rewards = forward_rows(model, tokens, lengths, 3, last_token_scores, (outputs,))
    values = forward_rows(model, tokens, lengths, 3, token_values_head, (tokens.shape[1],))
    if torch.distributed.get_rank() == 0:
        torch.save({"rewards": rewards, "values": values}, out)
    distributed.shutdown()
