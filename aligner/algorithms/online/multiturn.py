"""Multi-turn episodes as RL samples (`env.name`): the hook `RolloutTrainer.generate` calls in place of one
`engine.generate` when an environment is configured.

Each engine replica (a data-parallel or context-parallel rank's model-parallel group) runs its share of the
step's episodes with `aligner.envs.episodes.run_episodes`: every rank of the group takes part in the engine's
batched turns, and the first rank of the group runs the environments (its `EnvPool`) and broadcasts their
results over the group, so the ranks never disagree about an episode, whatever a tool's timing. A sample is
an episode: its response is every turn and observation, its `token_mask` marks the engine's tokens, and its
score is the environment's (so the reward functions do not score it again: `Environment.score` already
applied them to the final answer in the built-ins), and its `episode` the turns as text for the rollouts files.

With separate rollout workers (`generation.placement=separate`), the workers run the episodes instead: their
entry is `worker_main` (the worker of generation/rollout_worker.py with `worker_episodes` answering its
orders), the same `run_share` on their engine, and the trainer turns their Episodes into samples with the same
`as_samples`.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import Future

import torch.distributed as dist
from megatron.core import parallel_state as ps

from aligner.algorithms.online.samples import Sample
from aligner.envs.episodes import episode_metrics, run_episodes
from aligner.envs.pool import EnvPool
from aligner.generation import rng, rollout_worker
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


def episode_records(prompts: list) -> list[dict]:
    """What each episode's `reset` gets: the prompt's text and its record's fields."""
    return [{"prompt": p.text, **p.fields} for p in prompts]


def run_share(engine, tokenizer, prompt_ids: list, records: list[dict], seeds: list[int], params: SamplingParams,
              env_cfg, pool: EnvPool | None, seq_length: int) -> tuple[list, dict]:
    """This engine replica's episodes (`aligner.envs.episodes.Episode`s) and their metrics: the trainer's
    ranks and a rollout worker's alike."""
    return run_episodes(engine, tokenizer, prompt_ids, records, seeds, params, pool, max_turns=env_cfg.max_turns,
                        max_total_tokens=env_cfg.max_total_tokens or seq_length, failure_reward=env_cfg.failure_reward,
                        share=share_over_model_parallel_group)


def as_samples(prompts: list, episodes: list, version: int, tokenizer) -> list[Sample]:
    """The episodes of `prompts` (one each) as Samples, scored, with their token masks and summaries."""
    samples = []
    for prompt, e in zip(prompts, episodes):
        if e.prompt_ids != list(prompt.ids):  # reset gave a first observation: the episode's own prompt
            prompt = type(prompt)(e.prompt_ids, tokenizer.decode(e.prompt_ids), prompt.fields, prompt.source)
        samples.append(Sample(prompt, e.response_ids, e.logprobs, e.is_end, score=e.score, version=version,
                              token_mask=e.response_mask, episode=e.summary()))
    return samples


def episode_samples(engine, tokenizer, prompts: list, seeds: list[int], params: SamplingParams, env_cfg,
                    pool: EnvPool | None, version: int, seq_length: int) -> tuple[list[Sample], dict]:
    """One episode per prompt (`aligner.data.prompts.Prompt`, seeded with `seeds[i]`) as Samples with their
    scores set, and the episodes' metrics (`episode/*`, `fraction/env_errors`, ..., `timing/env_s`)."""
    episodes, metrics = run_share(engine, tokenizer, [p.ids for p in prompts], episode_records(prompts), seeds,
                                  params, env_cfg, pool, seq_length)
    return as_samples(prompts, episodes, version, tokenizer), metrics


def generate_episodes(engine, tokenizer, prompts: list, generations: int, first_id: int, params: SamplingParams,
                      env_cfg, pool: EnvPool | None, version: int, seq_length: int) -> tuple[list[Sample], dict]:
    """`RolloutTrainer.generate` for multi-turn runs: `generations` episodes of each prompt, group after group,
    on every rank. Episodes are split over the engine's replicas as single-turn samples are (contiguous shares
    of the prompts over the DP x CP ranks), episode k of the run seeded with `derive_seed(params.seed,
    first_id + k)`, then gathered; the metrics are over all of them (`timing/env_s`: the slowest replica)."""
    n = generations
    dp = ps.get_data_parallel_world_size(with_context_parallel=True)
    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    share = -(-len(prompts) // dp)
    mine = range(dp_rank * share * n, min(len(prompts), (dp_rank + 1) * share) * n)
    samples, metrics = episode_samples(engine, tokenizer, [prompts[k // n] for k in mine],
                                       [rng.derive_seed(params.seed, first_id + k) for k in mine], params, env_cfg,
                                       pool, version, seq_length)
    parts = collectives.all_gather_object((samples, metrics["timing/env_s"]),
                                          group=ps.get_data_parallel_group(with_context_parallel=True))
    samples = [s for part, _ in parts for s in part]
    return samples, step_metrics(samples, max(env_s for _, env_s in parts))


def step_metrics(samples: list[Sample], env_s: float) -> dict:
    """The episode metrics of `samples` (`episode/*`, `fraction/env_errors`, ...) with `timing/env_s` = env_s."""
    return episode_metrics([s.episode for s in samples], env_s)


def scores_future(samples: list[Sample]) -> Future:
    """The episodes' own scores as the reward scorer's future (`RolloutTrainer.submit_scores`'s result): the
    environment scored them, the reward functions do not again."""
    future = Future()
    future.set_result([s.score for s in samples])
    future.duration = 0.0
    return future


# ---- on separate rollout workers (generation.placement=separate) -----------------------------------------------
WORKER_ENTRY = "aligner.algorithms.online.multiturn:worker_main"  # the rollout workers' entry under env.name


@contextlib.contextmanager
def worker_episodes(cfg, engine, tokenizer):
    """A rollout worker's answer to a generate order under env.name (`rollout_worker.serve`): the order's
    episodes on the worker's engine, its first TP rank running the environments (an EnvPool of the run's
    env.* and reward.functions, as a trainer rank's), answered as the Episodes themselves and the seconds the
    environments took; the trainer makes them samples (`as_samples`) as its own ranks' episodes."""
    pool = start_env_pool(cfg)

    def generate(message: dict) -> dict:
        episodes, metrics = run_share(engine, tokenizer, message["prompts"], message["records"], message["seeds"],
                                      message["params"], cfg.env, pool, cfg.model.seq_length)
        return {"episodes": episodes, "env_s": [metrics["timing/env_s"]]}  # lists: the workers' shares joined

    try:
        yield generate
    finally:
        if pool is not None:
            pool.close()


def worker_main(argv: list[str]) -> None:
    """`python -m aligner.launch.worker aligner.algorithms.online.multiturn:worker_main CONFIG COMMAND`."""
    rollout_worker.main(argv, worker_episodes)
