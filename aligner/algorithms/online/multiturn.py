"""Multi-turn episodes as RL samples (`env.name`): the hook `RolloutTrainer.generate` calls in place of one
`engine.generate` when an environment is configured.

Each engine replica (a data-parallel or context-parallel rank's model-parallel group) runs its share of the
step's episodes with `aligner.envs.episodes.run_episodes`: every rank of the group takes part in the engine's
batched turns, and the first rank of the group runs the environments (its `EnvPool`) and broadcasts their
results over the group, so the ranks never disagree about an episode, whatever a tool's timing. A sample is
an episode: its response is every turn and observation, its `token_mask` marks the engine's tokens, and its
score is the environment's (so the reward functions do not score it again: `Environment.score` already
applied them to the final answer in the built-ins), and its `episode` the turns as text for the rollouts files.
"""
from __future__ import annotations

from concurrent.futures import Future

import torch.distributed as dist
from megatron.core import parallel_state as ps

from aligner.algorithms.online.samples import Sample
from aligner.envs.episodes import run_episodes
from aligner.envs.pool import EnvPool
from aligner.generation import rng
from aligner.generation.types import SamplingParams
from aligner.runtime import collectives


def runs_environments() -> bool:
    """This rank holds its replica's environments: the first rank of its model-parallel group."""
    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0


def start_env_pool(cfg) -> EnvPool | None:
    """The environments' worker processes of this rank (None where `env.name` is unset or another rank of the
    model-parallel group runs them); the builtins score final answers with `reward.functions`."""
    e = cfg.env
    if e.name is None or not runs_environments():
        return None
    options = {"rewards": list(cfg.reward.functions),
               "weights": None if cfg.reward.weights is None else list(cfg.reward.weights)}
    return EnvPool(e.name, options, concurrency=e.concurrency, timeout_s=e.timeout_s)


def share_over_model_parallel_group(results):
    """The environments' results of the group's first rank on every rank of the group."""
    group = ps.get_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return results
    return collectives.broadcast_object(results, src=dist.get_process_group_ranks(group)[0], group=group)


def episode_samples(engine, tokenizer, prompts: list, seeds: list[int], params: SamplingParams, env_cfg,
                    pool: EnvPool | None, version: int, seq_length: int) -> tuple[list[Sample], dict]:
    """One episode per prompt (`aligner.data.prompts.Prompt`, seeded with `seeds[i]`) as Samples with their
    scores set, and the episodes' metrics (`episode/*`, `fraction/env_errors`, ..., `timing/env_s`)."""
    records = [{"prompt": p.text, **p.fields} for p in prompts]
    episodes, metrics = run_episodes(
        engine, tokenizer, [p.ids for p in prompts], records, seeds, params, pool, max_turns=env_cfg.max_turns,
        max_total_tokens=env_cfg.max_total_tokens or seq_length, failure_reward=env_cfg.failure_reward,
        share=share_over_model_parallel_group)
    samples = []
    for prompt, e in zip(prompts, episodes):
        if e.prompt_ids != list(prompt.ids):  # reset gave a first observation: the episode's own prompt
            prompt = type(prompt)(e.prompt_ids, tokenizer.decode(e.prompt_ids), prompt.fields, prompt.source)
        samples.append(Sample(prompt, e.response_ids, e.logprobs, e.is_end, score=e.score, version=version,
                              token_mask=e.response_mask, episode=e.summary()))
    return samples, metrics


def generate_episodes(engine, tokenizer, prompts: list, generations: int, first_id: int, params: SamplingParams,
                      env_cfg, pool: EnvPool | None, version: int, seq_length: int) -> tuple[list[Sample], dict]:
    """`RolloutTrainer.generate` for multi-turn runs: `generations` episodes of each prompt, group after group,
    on every rank. Episodes are split over the engine's replicas as single-turn samples are (contiguous shares
    of the prompts over the DP x CP ranks), episode k of the run seeded with `derive_seed(params.seed,
    first_id + k)`, then gathered; the metrics are over the whole step (`timing/env_s`: the slowest replica)."""
    n = generations
    dp = ps.get_data_parallel_world_size(with_context_parallel=True)
    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    share = -(-len(prompts) // dp)
    mine = range(dp_rank * share * n, min(len(prompts), (dp_rank + 1) * share) * n)
    samples, metrics = episode_samples(engine, tokenizer, [prompts[k // n] for k in mine],
                                       [rng.derive_seed(params.seed, first_id + k) for k in mine], params, env_cfg,
                                       pool, version, seq_length)
    parts = collectives.all_gather_object((samples, metrics, len(samples)),
                                          group=ps.get_data_parallel_group(with_context_parallel=True))
    total = max(sum(count for _, _, count in parts), 1)
    step_metrics = {key: sum(m[key] * count for _, m, count in parts) / total
                    for key in metrics if key != "timing/env_s"}
    step_metrics["timing/env_s"] = max(m["timing/env_s"] for _, m, _ in parts)
    return [s for part, _, _ in parts for s in part], step_metrics


def scores_future(samples: list[Sample]) -> Future:
    """The episodes' own scores as the reward scorer's future (`RolloutTrainer.submit_scores`'s result): the
    environment scored them, the reward functions do not again."""
    future = Future()
    future.set_result([s.score for s in samples])
    future.duration = 0.0
    return future
