"""The forward step megatron's pipeline schedules call for losses on token log-probs (SFT, DPO,
policy losses): slice the micro-batch for this context-parallel rank, run the model, and on the
last pipeline stage return (loss sum, count, report sums); see trainer.py for the normalisation."""
from __future__ import annotations

from typing import Callable

import torch

from aligner.models.cp_attention import positions_on_rank
from aligner.models.logprobs import vocab_parallel_logprobs

# (token_logprobs [b, s], batch dict) -> (loss sum, count, report dict of summed tensors)
TokenLoss = Callable[[torch.Tensor, dict], tuple[torch.Tensor, torch.Tensor, dict]]


def slice_for_context_parallel(batch: dict) -> dict:
    """Keep this CP rank's two load-balanced chunks of every [b, s] tensor, plus position ids."""
    from megatron.core import parallel_state as ps

    seq_len = batch["tokens"].shape[1]
    cp = ps.get_context_parallel_world_size()
    positions = (positions_on_rank(seq_len, cp, ps.get_context_parallel_rank()) if cp > 1
                 else torch.arange(seq_len))
    sliced = {k: v[:, positions] if torch.is_tensor(v) and v.dim() == 2 else v for k, v in batch.items()}
    sliced["position_ids"] = positions.unsqueeze(0).expand(batch["tokens"].shape[0], -1)
    return sliced


def make_forward_step(token_loss: TokenLoss, vocab_size: int):
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None

    def forward_step(data_iterator, model):
        batch = slice_for_context_parallel(next(data_iterator))
        if device is not None:
            batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        output = model(batch["tokens"], batch["position_ids"], None)

        def loss_func(logits):
            logprobs = vocab_parallel_logprobs(logits, batch["labels"], vocab_size)
            loss, count, report = token_loss(logprobs, batch)
            report = {k: v.detach().float() for k, v in report.items()}
            report["count"] = count.detach().float()
            return loss, count.int(), report

        return output, loss_func

    return forward_step


def sft_loss(logprobs: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Next-token NLL summed over loss tokens; normalised by the global loss-token count."""
    from aligner.algorithms.functional import token_nll_sum

    loss = token_nll_sum(logprobs, batch["loss_mask"])
    return loss, batch["loss_mask"].sum(), {"loss": loss}
