"""`aligner serve reward checkpoint=DIR [server.port=P ...]`: a reward model behind PyTriton.

Endpoint `reward_model` (`protocol.reward_endpoint`): token ids with lengths, or text, in; one
reward per row (per attribute for a regression RM, unless `reward.attribute_weights` merges them),
optionally standardised. Requests are merged by Triton's dynamic batcher. With TP x PP x DP ranks
(`parallel.*`, `launcher.nproc_per_node`), global rank 0 hosts PyTriton and the others follow its
broadcasts (`engine`), so a TP=2 server serves the scores of a TP=1 one.
"""
from __future__ import annotations

import torch

from aligner.models.checkpoint import load_weights, read_metadata, scalar_head_outputs
from aligner.models.heads import last_token_scores
from aligner.models.scoring import build_scalar_model, forward_rows
from aligner.servers.common import Job, RequestReader, RewardOutput, as_tensors, init_job, load_server_tokenizer, \
    max_length, run_job, split_outputs
from aligner.servers.config import load_resolved_serve_config
from aligner.servers.engine import REWARD
from aligner.servers.protocol import reward_endpoint
from aligner.servers.triton import Binding


class RewardModel:
    """A reward checkpoint on every rank of the job; `scores` is collective."""

    def __init__(self, checkpoint, parallel, micro_batch_size: int):
        meta = read_metadata(checkpoint)
        if meta.get("head") != "reward":
            raise ValueError(f"{checkpoint} has a '{meta.get('head', 'lm')}' head, not a reward model's; train one "
                             f"with `aligner train rm` or import one with `aligner convert hf-to-mcore`")
        self.num_outputs = scalar_head_outputs(checkpoint)
        self.model, self.model_cfg, self.vocab_size = build_scalar_model(checkpoint, parallel, self.num_outputs)
        load_weights(checkpoint, self.model)
        self.model.eval()
        self.micro_batch_size = micro_batch_size

    def scores(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor | None:
        """Raw head outputs [B, A] on rank 0 (None elsewhere)."""
        return forward_rows(self.model, tokens, lengths, self.micro_batch_size, last_token_scores, (self.num_outputs,))


def main(argv: list[str]) -> None:
    """One rank started by the launcher; argv = [resolved config.yaml]."""
    run(load_resolved_serve_config(argv[0], "reward"))


def run(cfg) -> None:
    init_job(cfg)
    reward = RewardModel(cfg.checkpoint, cfg.parallel, cfg.server.forward_micro_batch_size)
    job = Job() if torch.distributed.get_rank() == 0 else None

    def bindings():
        reader = RequestReader(cfg.server.max_batch_size, max_length(cfg, reward.model_cfg), reward.vocab_size,
                               load_server_tokenizer(cfg.tokenizer, cfg.checkpoint))
        output = RewardOutput(cfg.reward, reward.num_outputs)

        def infer(requests):
            tokens, lengths, counts = reader.token_batch(requests)
            with job.step(REWARD, as_tensors(tokens=tokens, lengths=lengths)) as sent:
                raw = reward.scores(sent["tokens"], sent["lengths"])
            return split_outputs({"rewards": output(raw.cpu().numpy())}, counts)

        return [Binding(reward_endpoint(output.num_outputs), infer, cfg.server.max_batch_size)]

    run_job(cfg, job, bindings, {REWARD: lambda t: reward.scores(t["tokens"], t["lengths"])})
