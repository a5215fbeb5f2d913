"""Subprocess side of tests/e2e/test_recipes.py (a fresh process: its own torch.distributed world).

    python -m tests.recipe_workers meta SPEC.json     one pipeline stage's GPTModel on the meta device per entry
    python -m tests.recipe_workers recompute          tiny model: gradients with and without recomputation

`meta`: SPEC is a list of {"model": ModelConfig fields, "vocab_size", "world_size", "rank"}. Each entry runs in a
fake process group (torch's "fake" backend: collectives are no-ops) of `world_size` ranks in which this process is
`rank`, so megatron's parallel state has the recipe's real TP/PP/DP groups and sizes, and `build_gpt` builds that
rank's stage with no memory (meta tensors). Prints one JSON list: parameters, stage, DP size and the recompute
setting megatron received, per entry.
"""
from __future__ import annotations

import json
import sys


def meta(spec_path: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from omegaconf import OmegaConf
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from aligner.config.schema import ModelConfig
    from aligner.models.gpt import build_gpt
    from aligner.runtime import cpu_shims
    from aligner.runtime.seeding import seed_everything

    cpu_shims.apply()
    out = []
    for entry in json.loads(open(spec_path).read()):
        m = OmegaConf.merge(OmegaConf.structured(ModelConfig), entry["model"])
        dist.init_process_group("fake", rank=entry["rank"], world_size=entry["world_size"], store=FakeStore())
        ps.initialize_model_parallel(m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                                     context_parallel_size=m.context_parallel_size, create_gloo_process_groups=False)
        seed_everything(0)
        with torch.device("meta"):
            model = build_gpt(m, entry["vocab_size"])
        out.append({"params": sum(p.numel() for p in model.parameters()),
                    "devices": sorted({p.device.type for p in model.parameters()}),
                    "pp_rank": ps.get_pipeline_model_parallel_rank(), "tp": ps.get_tensor_model_parallel_world_size(),
                    "dp": ps.get_data_parallel_world_size(), "recompute": model.config.recompute_granularity,
                    "pre_process": model.pre_process, "post_process": model.post_process})
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    print(json.dumps(out))


def recompute() -> None:
    """Loss and gradients of one forward/backward of the tiny model (4 layers) under recompute = none, selective
    and full, from the same weights and batch (recomputation must not change them), and how many times the core
    attention ran (it must run again in the backward pass when recomputed)."""
    import torch
    from omegaconf import OmegaConf

    from aligner.config.schema import ModelConfig
    from aligner.models.gpt import build_gpt
    from aligner.runtime import cpu_shims, distributed
    from aligner.runtime.seeding import seed_everything

    cpu_shims.apply()
    distributed.init_process_group()
    distributed.init_model_parallel()
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(32).expand(2, 32)
    causal = torch.triu(torch.ones(32, 32, dtype=torch.bool), diagonal=1)[None, None]  # True = masked out
    results = {}
    for mode in ("none", "selective", "full"):
        seed_everything(7)
        m = OmegaConf.merge(OmegaConf.structured(ModelConfig), {"recompute": mode})
        model = build_gpt(m, 300)
        calls = []  # core-attention forwards: once a layer, and again in the backward pass when recomputed
        for layer in model.decoder.layers:
            layer.self_attention.core_attention.register_forward_hook(lambda *_: calls.append(1))
        loss = model(tokens, position_ids, causal, labels=tokens).float().mean()
        loss.backward()
        results[mode] = {"loss": loss.item(), "config": model.config.recompute_granularity, "attention_calls": len(calls),
                         "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    ref = results["none"]["grads"]
    print(json.dumps({mode: {"loss": r["loss"], "config": r["config"], "attention_calls": r["attention_calls"],
                             "max_grad_diff": max((r["grads"][n] - g).abs().max().item() for n, g in ref.items()),
                             "grad_norm": sum(g.square().sum().item() for g in r["grads"].values()) ** 0.5}
                      for mode, r in results.items()}))
    distributed.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "meta":
        meta(sys.argv[2])
    else:
        recompute()
