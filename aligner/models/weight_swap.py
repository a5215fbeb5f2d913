"""Several sets of weights for one model's parameters: copies kept in CPU memory and swapped in when
needed (NeMo-Aligner's CPU weight swap). The reference model of the preference and RL trainers uses
it (`cpu_swap`: the frozen weights pass through the policy's parameters), and so does the critic
server's co-hosted reward model. No device memory beyond the model's own."""
from __future__ import annotations

import torch


class CpuWeights:
    """A CPU copy of named parameters (pinned when CUDA is present, so that copies are asynchronous)."""

    def __init__(self, params: dict[str, torch.Tensor], copy: bool = True):
        pinned = torch.cuda.is_available()
        self.tensors = {n: (p.detach().to("cpu", copy=True).pin_memory() if pinned else p.detach().to("cpu", copy=True))
                        if copy else torch.empty_like(p, device="cpu", pin_memory=pinned) for n, p in params.items()}

    @torch.no_grad()
    def save(self, params: dict[str, torch.Tensor]) -> None:
        """Copy `params` into this store."""
        for name, p in params.items():
            self.tensors[name].copy_(p, non_blocking=True)
        _synchronize()

    @torch.no_grad()
    def load_into(self, params: dict[str, torch.Tensor]) -> None:
        """Copy this store's weights into `params`."""
        for name, p in params.items():
            p.copy_(self.tensors[name], non_blocking=True)
        _synchronize()


@torch.no_grad()
def copy_weights(source: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> None:
    """Copy named tensors into the same-named parameters of another model (on any device)."""
    for name, p in source.items():
        target[name].copy_(p)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
