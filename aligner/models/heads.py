"""Scalar heads that replace the LM output layer: a reward head (one or more scores per sequence,
read at the last token) and a value head (one value per token, for the PPO critic).

The head is a plain linear layer replicated on every tensor-parallel rank: its input (the final
hidden state) is identical on all TP ranks, so its gradients are too. Under sequence parallelism
the hidden states arrive split along the sequence and are gathered first.
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

HEAD_KINDS = ("lm", "reward", "value")


class ScalarHead(MegatronModule):
    """[s, b, hidden] -> [s, b, num_outputs]; called like megatron's output layer."""

    def __init__(self, config, num_outputs: int = 1):
        super().__init__(config=config)
        self.num_outputs = num_outputs
        self.sequence_parallel = config.sequence_parallel
        self.weight = torch.nn.Parameter(torch.empty(num_outputs, config.hidden_size, dtype=config.params_dtype))
        with torch.no_grad():
            config.init_method(self.weight)
        # megatron's DDP/optimizer read these attributes; the head is not split over TP.
        self.weight.tensor_model_parallel = False
        self.weight.sequence_parallel = False

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight.to(hidden_states.dtype)), None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return make_sharded_tensors_for_checkpoint({"weight": self.weight}, prefix, {}, sharded_offsets)


def attach_scalar_head(model, num_outputs: int = 1):
    """Replace the GPTModel's LM output layer (last pipeline stage only) by a scalar head.
    The model then returns [b, s, num_outputs] instead of vocabulary logits."""
    if getattr(model, "share_embeddings_and_output_weights", False):
        model.share_embeddings_and_output_weights = False  # the head has its own weight
    if model.post_process:
        model.output_layer = ScalarHead(model.config, num_outputs)
        if torch.cuda.is_available():
            model.output_layer.cuda()
    return model


def last_token_scores(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Reward of each sequence: the head output at its last real token, `lengths - 1`
    (as Hugging Face sequence classification does). values [b, s, k], lengths [b] -> [b, k]."""
    index = (lengths.long() - 1).clamp(min=0).view(-1, 1, 1).expand(-1, 1, values.shape[-1])
    return values.gather(1, index).squeeze(1)
