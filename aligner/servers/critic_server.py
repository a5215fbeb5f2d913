"""`aligner serve critic checkpoint=DIR [reward_checkpoint=RM] [server.port=P ...]`: the PPO critic.

Endpoints (`protocol`):
* `critic_infer`: per-token values [B, S] (plus the co-hosted reward model's rewards) and the
  server's seconds for the call's forward;
* `critic_train`: the clipped value loss on the received returns; the request's rows are cut into
  `trainer.global_batch_size`-row optimizer steps (the last one padded with masked rows), repeated
  for `trainer.epochs`; replies the mean loss over those steps, the fraction of masked tokens whose
  value was clipped (over all the steps) and the server's seconds;
* `critic_save` (the actor's `step` N): a checkpoint `<run_dir>/checkpoints/step_<N:06d>` (weights,
  optimizer, LR schedule; its trainer state records `actor_step` N and the critic's optimizer
  `updates`), so that every actor checkpoint has the critic's of the same step;
* `critic_load` (step N): back to the checkpoint saved at actor step N, on every rank; a step never
  saved is refused (the server serves on). A started server resumes from `resume_step`'s checkpoint
  when set (a resumed actor's step: the critic may have saved later ones), else from the latest;
* `reward_model` when `reward_checkpoint` is set: the reward model shares the critic's device
  memory; its weights live on the CPU and are swapped in when needed (it must have the critic's
  architecture, which holds when the critic was initialised from it).
One lock serialises every endpoint, since they share the weights. The critic starts from
`checkpoint`: a reward model (all weights when its head has one output), a language model (the
head starts fresh) or a critic.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch
from megatron.core import parallel_state as ps

from aligner.algorithms.online.maths import clipped_value_loss
from aligner.algorithms.shared.maths import masked_sum
from aligner.algorithms.shared.training_step import forward_backward, optimizer_step
from aligner.models import checkpoint, lora
from aligner.models.forward_step import head_values, make_forward_step, token_reduction
from aligner.models.heads import ScalarHead, last_token_scores
from aligner.models.scoring import build_scalar_model, forward_rows, token_values_head
from aligner.models.training import wrap_for_training
from aligner.models.weight_swap import CpuWeights
from aligner.servers import protocol
from aligner.servers.common import Job, RequestReader, RewardOutput, as_tensors, init_job, load_server_tokenizer, \
    max_length, run_job, split_outputs
from aligner.servers.config import critic_checkpoints, load_resolved_serve_config, no_critic_checkpoint
from aligner.servers.engine import LOAD, REWARD, SAVE, TRAIN, VALUES
from aligner.servers.protocol import CRITIC_LOAD, CRITIC_SAVE, CRITIC_TRAIN, TRAIN_MAX_ROWS, RequestError, \
    check_float_like, check_step, check_tokens, critic_infer_endpoint, reward_endpoint
from aligner.servers.triton import Binding

log = logging.getLogger(__name__)
ARCHITECTURE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                     "kv_channels", "add_qkv_bias", "tie_embeddings")


def _backbone(model) -> dict[str, torch.nn.Parameter]:
    """Every parameter but the head's and LoRA adapters' (the critic and the co-hosted reward model share these)."""
    return {n: p for n, p in checkpoint.unwrap(model).named_parameters()
            if not n.startswith("output_layer.") and not lora.is_adapter_parameter(n)}


def value_loss(clip: float):
    """The critic's token loss: PPO's clipped value loss on the returns (`maths.clipped_value_loss`),
    summed over the masked tokens; count = masked tokens; report `clipped` = masked tokens whose
    clipped term was the larger one."""

    def loss(values, local):
        token_loss, clipped = clipped_value_loss(values[..., 0], local["prev_values"], local["returns"], clip)
        loss = masked_sum(token_loss, local["mask"])
        return loss, local["mask"].sum(), {"loss": loss, "clipped": masked_sum(clipped, local["mask"])}

    return loss


def train_summary(step_sums: list[dict]) -> tuple[float, float]:
    """(loss_mean, clip_fraction) of one critic_train request from its optimizer steps' summed
    reports (`value_loss`'s, summed over the data-parallel ranks): loss_mean is the mean over the
    steps of each step's loss per masked token; clip_fraction is the clipped masked tokens over all
    the masked tokens of all the steps (a token-weighted fraction, not a mean of the steps')."""
    losses = [s.get("loss", 0.0) / max(s.get("count", 0.0), 1.0) for s in step_sums]
    tokens = sum(s.get("count", 0.0) for s in step_sums)
    return float(np.mean(losses)), sum(s.get("clipped", 0.0) for s in step_sums) / max(tokens, 1.0)


def _same_path(a, b) -> bool:
    return b is not None and Path(a).resolve() == Path(b).resolve()


class Critic:
    """The critic (and optionally a co-hosted reward model) on every rank; methods are collective."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.checkpoints = Path(cfg.run_dir) / "checkpoints"
        saved = critic_checkpoints(self.checkpoints)
        step = cfg.resume_step if cfg.resume_step is not None else max(saved, default=None)
        resume = self.checkpoint_for(step) if step is not None else None
        source = resume or cfg.checkpoint
        if source is None:
            raise ValueError("the critic needs initial weights: set checkpoint=DIR (a reward, language-model or "
                             f"critic checkpoint), or resume from {self.checkpoints}")
        gpt, self.model_cfg, self.vocab_size = build_scalar_model(source, cfg.parallel, 1)
        self.model_cfg.lora = cfg.lora  # wrap_for_training adds the adapters (the value head trains too)
        # a LoRA critic's frozen base: its initial weights, or those its resumed checkpoint names
        self.lora_base = (checkpoint.read_metadata(resume)["lora"]["base"]["path"]
                          if resume is not None and "lora" in checkpoint.read_metadata(resume) else cfg.checkpoint)
        self.inner = gpt
        self.model, self.optimizer, self.scheduler = wrap_for_training(gpt, self.model_cfg, cfg.optim)
        self.train_step = make_forward_step(head_values, token_reduction(value_loss(cfg.trainer.loss_clip)))
        self.value_head = gpt.output_layer if gpt.post_process else None
        self.reward = None
        if cfg.reward_checkpoint:
            self._stash_reward_model(cfg.reward_checkpoint, source)
        self.updates = 0  # optimizer steps taken, over the critic's whole life
        if resume is not None:
            self._load_state(resume)
        else:
            checkpoint.load_into_scalar_model(cfg.checkpoint, self.model, 1)
            self.optimizer.reload_model_params()  # bf16: its fp32 main params still hold the initial weights
            log.info("critic initialised from %s", cfg.checkpoint)
        self.model.eval()
        self.resident = "critic"

    # ---- weight swap -----------------------------------------------------------------------------------
    def _stash_reward_model(self, path, critic_source) -> None:
        """Load the reward model through the critic's own parameters, keep its weights on the CPU."""
        mine, theirs = checkpoint.read_metadata(critic_source)["model"], checkpoint.read_metadata(path)["model"]
        differ = [k for k in ARCHITECTURE_KEYS if mine.get(k) != theirs.get(k)]
        if differ:
            raise ValueError(f"reward_checkpoint={path} cannot share the critic's weights: "
                             + ", ".join(f"{k} {theirs.get(k)} vs {mine.get(k)}" for k in differ)
                             + "; serve it on its own with `aligner serve reward`")
        outputs = checkpoint.scalar_head_outputs(path)
        self.reward_head = ScalarHead(self.inner.config, outputs) if self.inner.post_process else None
        if self.reward_head is not None:
            if torch.cuda.is_available():
                self.reward_head.cuda()
            self.inner.output_layer = self.reward_head
        checkpoint.load_into_scalar_model(path, self.model, outputs)
        if lora.enabled(self.cfg.lora) and _same_path(path, self.lora_base):
            # a LoRA critic's frozen base is the reward model itself: scoring switches the adapters off and
            # the head, and no weights are swapped or copied
            self._reward_weights = self._critic_weights = None
            log.info("the reward model %s is the LoRA critic's frozen base: it scores with the adapters off, "
                     "no weights swapped", path)
        else:
            self._reward_weights = CpuWeights(_backbone(self.model))
            self._critic_weights = CpuWeights(_backbone(self.model), copy=False)  # filled at the first swap
        if self.value_head is not None:
            self.inner.output_layer = self.value_head
        self.reward_outputs = outputs
        self.reward = True

    def _use(self, which: str) -> None:
        if self.resident == which:
            return
        params = _backbone(self.model)
        if which == "reward":
            if self._reward_weights is not None:
                self._critic_weights.save(params)
                self._reward_weights.load_into(params)
            head = self.reward_head
        else:
            if self._critic_weights is not None:
                self._critic_weights.load_into(params)
            head = self.value_head
        if head is not None:
            self.inner.output_layer = head
        self.resident = which

    # ---- checkpoints -----------------------------------------------------------------------------------
    def checkpoint_for(self, step: int) -> Path:
        """The checkpoint saved at actor step `step`; RequestError naming the steps there are if none."""
        saved = critic_checkpoints(self.checkpoints)
        if step not in saved:
            raise RequestError(no_critic_checkpoint(step, self.checkpoints, saved))
        return saved[step]

    def _load_state(self, path: Path) -> None:
        state, _ = checkpoint.load_training_state(path, self.model, self.optimizer)
        # megatron's scheduler adds the saved step count to its own: start it from 0 (a live critic_load)
        self.scheduler.num_steps = 0
        self.scheduler.load_state_dict(state["scheduler"])
        self.updates = state["updates"]
        log.info("critic loaded %s (actor step %d, %d critic updates)", path, state["actor_step"], self.updates)

    # ---- collective operations ------------------------------------------------------------------------
    def values(self, tokens, lengths):
        self._use("critic")
        return forward_rows(self.model, tokens, lengths, self.cfg.server.forward_micro_batch_size, token_values_head,
                            (tokens.shape[1],))

    def rewards(self, tokens, lengths):
        self._use("reward")
        with lora.disabled(self.model):  # the reward model has no adapters
            return forward_rows(self.model, tokens, lengths, self.cfg.server.forward_micro_batch_size,
                                last_token_scores, (self.reward_outputs,))

    def infer(self, tokens, lengths) -> tuple:
        """(values, rewards or None); whichever model is resident runs first (one swap, not two)."""
        if self.reward and self.resident == "reward":
            rewards = self.rewards(tokens, lengths)
            return self.values(tokens, lengths), rewards
        values = self.values(tokens, lengths)
        return values, (self.rewards(tokens, lengths) if self.reward else None)

    def train(self, batch: dict) -> tuple[float, float]:
        """Optimizer steps on `batch` (tokens, returns, prev_values, mask); `train_summary`'s
        (loss_mean, clip_fraction)."""
        self._use("critic")
        t = self.cfg.trainer
        rows, width = batch["tokens"].shape
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        per_rank = t.global_batch_size // dp
        step_sums = []
        self.model.train()
        for _ in range(t.epochs):
            for start in range(0, rows, t.global_batch_size):
                chunk = {k: v[start:start + t.global_batch_size] for k, v in batch.items()}
                short = t.global_batch_size - chunk["tokens"].shape[0]
                if short:  # masked padding rows keep every step's shape (and the DP split) fixed
                    chunk = {k: torch.cat([v, v.new_zeros((short, width))]) for k, v in chunk.items()}
                mine = {k: v[dp_rank * per_rank:(dp_rank + 1) * per_rank] for k, v in chunk.items()}
                micro = [{k: v[i:i + t.micro_batch_size] for k, v in mine.items()}
                         for i in range(0, per_rank, t.micro_batch_size)]
                step_sums.append(forward_backward(self.model, self.optimizer, self.train_step, micro, width))
                optimizer_step(self.optimizer, self.scheduler)
                self.updates += 1
        self.model.eval()
        return train_summary(step_sums)

    def save(self, actor_step: int) -> None:
        """The checkpoint of the actor's step `actor_step` (replacing one saved at that step before)."""
        self._use("critic")
        state = {"actor_step": actor_step, "updates": self.updates, "scheduler": self.scheduler.state_dict()}
        path = checkpoint.save_checkpoint(self.checkpoints / f"step_{actor_step:06d}", self.model, self.model_cfg,
                                          self.vocab_size, optimizer=self.optimizer, trainer_state=state, head="value",
                                          lora_base=self.lora_base,
                                          extra_meta={"scalar_head": {"num_outputs": 1, "attributes": None,
                                                                      "loss": "clipped_value"}})
        if torch.distributed.get_rank() == 0:
            log.info("saved critic checkpoint %s (%d critic updates)", path, self.updates)

    def load(self, actor_step: int) -> None:
        """Weights, optimizer, LR schedule and update count of the checkpoint saved at `actor_step`."""
        path = self.checkpoint_for(actor_step)
        self._use("critic")
        self._load_state(path)


def main(argv: list[str]) -> None:
    run(load_resolved_serve_config(argv[0], "critic"))


def run(cfg) -> None:
    init_job(cfg)
    critic = Critic(cfg)
    job = Job() if torch.distributed.get_rank() == 0 else None
    handlers = {
        VALUES: lambda t: critic.infer(t["tokens"], t["lengths"]),
        REWARD: lambda t: critic.rewards(t["tokens"], t["lengths"]),
        TRAIN: lambda t: critic.train(t),
        SAVE: lambda t: critic.save(int(t["step"][0])),
        LOAD: lambda t: critic.load(int(t["step"][0])),
    }

    def bindings():
        longest = max_length(cfg, critic.model_cfg)
        tokenizer = load_server_tokenizer(cfg.tokenizer, cfg.reward_checkpoint or cfg.checkpoint)
        reader = RequestReader(cfg.server.max_batch_size, longest, critic.vocab_size, tokenizer)
        output = RewardOutput(cfg.reward, critic.reward_outputs) if critic.reward else None

        def infer(requests):
            tokens, lengths, counts = reader.token_batch(requests)
            with job.step(VALUES, as_tensors(tokens=tokens, lengths=lengths)) as sent:
                start = time.perf_counter()
                values, rewards = critic.infer(sent["tokens"], sent["lengths"])
                values = values.cpu().numpy().astype(np.float32)
                seconds = time.perf_counter() - start
            outputs = {protocol.VALUES.name: values,
                       protocol.SECONDS.name: np.full((len(values), 1), seconds, dtype=np.float32)}
            if rewards is not None:
                outputs["rewards"] = output(rewards.cpu().numpy())
            # rows keep the width of the merged call; each request gets back its own width
            return [{k: (v[:, :requests[i]["tokens"].shape[1]] if k == protocol.VALUES.name else v)
                     for k, v in out.items()} for i, out in enumerate(split_outputs(outputs, counts))]

        def reward_infer(requests):
            tokens, lengths, counts = reader.token_batch(requests)
            with job.step(REWARD, as_tensors(tokens=tokens, lengths=lengths)) as sent:
                rewards = critic.rewards(sent["tokens"], sent["lengths"])
            return split_outputs({"rewards": output(rewards.cpu().numpy())}, counts)

        def train(requests):
            (request,) = requests
            tokens = request.get("tokens")
            if tokens is None or np.asarray(tokens).ndim != 2:
                raise RequestError("input 'tokens' must be int64 [batch, length]")
            lengths = np.full((tokens.shape[0], 1), tokens.shape[1], dtype=np.int64)
            tokens, _ = check_tokens({"tokens": tokens, "sequence_lengths": lengths}, max_rows=TRAIN_MAX_ROWS,
                                     max_length=longest, vocab_size=critic.vocab_size)
            batch = {"tokens": tokens}
            for spec in CRITIC_TRAIN.inputs[1:]:
                batch[spec.name] = check_float_like(request, spec, tokens.shape)
            if not batch["mask"].any():
                raise RequestError("'mask' selects no token: nothing to train on")
            with job.step(TRAIN, as_tensors(**batch)) as sent:
                start = time.perf_counter()
                loss, clip_fraction = critic.train(sent)
                seconds = time.perf_counter() - start
            return [{protocol.LOSS_MEAN.name: np.array([loss], dtype=np.float32),
                     protocol.CLIP_FRACTION.name: np.array([clip_fraction], dtype=np.float32),
                     protocol.SECONDS.name: np.array([seconds], dtype=np.float32)}]

        def save(requests):
            (request,) = requests
            step = check_step(request)
            with job.step(SAVE, as_tensors(step=np.array([step], dtype=np.int64))):
                critic.save(step)
            return [{protocol.STEP.name: np.array([step], dtype=np.int64)}]

        def load(requests):
            (request,) = requests
            step = check_step(request)
            critic.checkpoint_for(step)  # a step never saved fails this request before any rank acts
            with job.step(LOAD, as_tensors(step=np.array([step], dtype=np.int64))):
                critic.load(step)
            return [{protocol.STEP.name: np.array([step], dtype=np.int64)}]

        result = [Binding(critic_infer_endpoint(output.num_outputs if output else 0), infer, cfg.server.max_batch_size),
                  Binding(CRITIC_TRAIN, train, TRAIN_MAX_ROWS), Binding(CRITIC_SAVE, save, 1),
                  Binding(CRITIC_LOAD, load, 1)]
        if output is not None:
            result.append(Binding(reward_endpoint(output.num_outputs), reward_infer, cfg.server.max_batch_size))
        return result

    run_job(cfg, job, bindings, handlers)
