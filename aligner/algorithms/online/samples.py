"""A step's rollout samples and what happens to them between generation and the loss: rewards (with
DAPO's over-long penalty and NeMo-Aligner's KL-in-reward), validity, dynamic sampling's choice of
groups, group advantages, and the per-step rollout metrics.

A step holds groups of `num_generations` samples of one prompt, laid out group after group; every
rank holds the same list (generation is split over data-parallel replicas, then gathered). A sample
is *valid* when it counts in learning; an unscored sample, one cut at max_new_tokens under
`overlong.mask`, and the filler groups of a short dynamic-sampling step are not: they get advantage
0 and no token of theirs enters a loss or a denominator.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from aligner.algorithms.online.maths import group_advantages, overlong_penalty


@dataclass
class Sample:
    prompt: object  # an `aligner.data.prompts.Prompt`: ids, text, fields for the reward functions
    response_ids: list[int]
    engine_logprobs: list[float]  # log q of each response token under the engine's sampling distribution
    is_end: bool  # stopped on its own (eos, stop token or string), not cut at max_new_tokens
    score: float | None = None  # the reward functions' weighted sum; None = could not be scored
    reward: float = 0.0  # what the advantages see: score + over-long penalty - KL (when in the reward)
    valid: bool = True
    advantage: float = 0.0
    version: int = 0  # the policy version it was generated with (the steps trained before; separate placement)
    # a multi-turn episode's (aligner/envs/episodes.py): 1 on the engine's tokens, 0 on the environment's
    # observations between turns; None = every response token is the engine's (single-turn)
    token_mask: list[int] | None = None
    episode: object = None  # a multi-turn sample's `aligner.envs.episodes.Summary`: turns, ends, transcript

    def response_token_mask(self) -> list[int]:
        """1 on the response tokens the loss trains (the engine's), 0 on observation tokens."""
        return [1] * len(self.response_ids) if self.token_mask is None else list(self.token_mask)

    def sequence(self) -> tuple[list[int], list[int]]:
        """(ids, mask): the prompt then the response, the response's own tokens trained on."""
        prompt = list(self.prompt.ids)
        return prompt + self.response_ids, [0] * len(prompt) + self.response_token_mask()


def groups_of(samples: list[Sample], group_size: int) -> list[list[Sample]]:
    return [samples[i:i + group_size] for i in range(0, len(samples), group_size)]


def apply_scores(samples: list[Sample], scores: list[float | None], algorithm, max_new_tokens: int) -> None:
    """Set each sample's score, reward and validity from the reward functions' results."""
    lengths = torch.tensor([len(s.response_ids) for s in samples])
    o = algorithm.overlong
    penalties = overlong_penalty(lengths, max_new_tokens, o.buffer, o.factor).tolist()
    for sample, score, penalty in zip(samples, scores, penalties):
        sample.score = score
        sample.valid = score is not None and (sample.is_end or not o.mask)
        sample.reward = (score + penalty) if score is not None else 0.0


def informative(group: list[Sample]) -> bool:
    """A group that teaches something: two or more valid samples whose rewards differ."""
    rewards = {s.reward for s in group if s.valid}
    return len(rewards) > 1


def choose_groups(kept: list[list[Sample]], dropped: list[list[Sample]], wanted: int) -> list[Sample]:
    """Dynamic sampling's batch: the first `wanted` informative groups; when too few were found within
    the refills, dropped groups fill the batch (keeping its shape) with every sample made invalid."""
    chosen = kept[:wanted]
    for group in dropped[:wanted - len(chosen)]:
        for sample in group:
            sample.valid = False
        chosen.append(group)
    return [s for group in chosen for s in group]


def subtract_kl(samples: list[Sample], kl_means: list[float], coef: float) -> None:
    """KL in the reward (NeMo-Aligner's REINFORCE): reward -= coef x the sample's masked-mean token KL."""
    for sample, kl in zip(samples, kl_means):
        sample.reward -= coef * kl


def set_advantages(samples: list[Sample], algorithm) -> torch.Tensor:
    """Group advantages of the whole step (`maths.group_advantages`), stored on the samples."""
    rewards = torch.tensor([s.reward for s in samples])
    valid = torch.tensor([s.valid for s in samples])
    baseline = torch.tensor([s.is_end for s in samples]) if algorithm.baseline_ended_only else None
    advantages = group_advantages(rewards, algorithm.num_generations, str(algorithm.advantage), mask=valid,
                                  baseline_mask=baseline)
    for sample, advantage in zip(samples, advantages.tolist()):
        sample.advantage = advantage
    return advantages


def rollout_metrics(samples: list[Sample], dropped_groups: int, seen_groups: int) -> dict:
    """reward, length, ended / unscored / dropped fractions and advantage statistics of a step."""
    scores = [s.score for s in samples if s.score is not None]
    valid_advantages = [s.advantage for s in samples if s.valid]
    metrics = {"reward/mean": statistics.fmean(scores) if scores else float("nan"),
               "reward/std": statistics.pstdev(scores) if scores else float("nan"),
               "response_length/mean": statistics.fmean(len(s.response_ids) for s in samples),
               "fraction/ended": statistics.fmean(s.is_end for s in samples),
               "fraction/unscored": 1 - len(scores) / len(samples),
               "fraction/valid": statistics.fmean(s.valid for s in samples),
               "fraction/dropped_groups": dropped_groups / max(seen_groups, 1)}
    if valid_advantages:
        metrics["advantages/mean"] = statistics.fmean(valid_advantages)
        metrics["advantages/std"] = statistics.pstdev(valid_advantages)
    return metrics
