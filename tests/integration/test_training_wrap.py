"""`wrap_for_training` on CPU: megatron's torch AdamW runs torch's fused kernel, and its updates match
torch's per-op AdamW on the same gradients (one process)."""
import torch

from tests.conftest import build_single_process_gpt


def test_cpu_optimizer_is_fused_and_matches_per_op_adamw():
    from aligner.config.schema import ModelConfig, OptimConfig
    from aligner.models.training import wrap_for_training
    from omegaconf import OmegaConf

    gpt = build_single_process_gpt(7)
    reference = {n: torch.nn.Parameter(p.detach().clone()) for n, p in gpt.named_parameters()}
    initial = {n: p.detach().clone() for n, p in gpt.named_parameters()}
    optim_cfg = OmegaConf.structured(OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0, scheduler="constant",
                                                 decay_steps=10, warmup_steps=0))
    ddp, optimizer, scheduler = wrap_for_training(gpt, OmegaConf.structured(ModelConfig), optim_cfg)
    inner = optimizer.optimizer
    assert all(group["fused"] for group in inner.param_groups)

    by_tensor = {p: n for n, p in gpt.named_parameters()}
    groups = [{**{k: v for k, v in group.items() if k not in ("params", "fused", "foreach")},
               "params": [reference[by_tensor[p]] for p in group["params"]]} for group in inner.param_groups]
    per_op = torch.optim.AdamW(groups, foreach=False)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        for name, p in gpt.named_parameters():
            grad = torch.randn(p.shape, generator=generator)
            p.main_grad.copy_(grad)
            reference[name].grad = grad.clone()
        assert optimizer.step()[0]
        scheduler.step(1)
        per_op.step()
    moved = 0
    for name, p in gpt.named_parameters():
        moved += int(not torch.equal(p.detach(), initial[name]))
        assert torch.allclose(p.detach(), reference[name].detach(), atol=1e-6, rtol=0), name
    assert moved == len(initial)
