"""Online RL's pure tensor maths: the policy and value losses, KL estimators, advantages, GAE. No
distributed calls, no model calls. Conventions: `mask` is 1.0 for tokens that count and 0.0 otherwise.
"""
from __future__ import annotations

import torch

from aligner.algorithms.shared.maths import masked_mean


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO value loss (Schulman et al. 2017; OpenAI baselines, NeMo-Aligner): with
    V_clip = V_old + clamp(V - V_old, -clip, clip), loss = 1/2 max((V - R)^2, (V_clip - R)^2).
    Returns (loss [b, s], clipped [b, s]: 1.0 where the clipped term was the larger one)."""
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_error, clipped_error = (values - returns).pow(2), (clipped_values - returns).pow(2)
    return 0.5 * torch.maximum(unclipped_error, clipped_error), (clipped_error > unclipped_error).float()


# ---- online RL ---------------------------------------------------------------------------------------
# Token tensors are [batch, seq] over the whole rollout (prompt, response, padding); `mask` is 1.0 on
# the response tokens that count. Advantages, returns and KL are computed without grad.
KL_ESTIMATORS = ("k1", "k2", "k3", "abs")
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
RATIO_LEVELS = ("token", "sequence")


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi, with d = log pi - log ref (Schulman,
    "Approximating KL divergence", 2020): k1 = d (unbiased, high variance), k2 = d^2 / 2,
    k3 = exp(-d) - 1 + d (unbiased, >= 0, low variance), abs = |d|."""
    _check_choice("estimator", estimator, KL_ESTIMATORS)
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.pow(2)
    if estimator == "k3":
        return torch.expm1(-d) + d
    return d.abs()


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """KL-in-reward (Ziegler et al. 2019; NeMo-Aligner, OpenRLHF): -kl_coef * kl on every masked token,
    plus the sequence's score ([batch]) on its last masked token. 0 off the mask (whatever `kl` holds
    there); a row with an empty mask gets nothing, its score included."""
    valid = mask.bool()
    rewards = torch.where(valid, -kl_coef * kl.float(), 0.0)
    positions = torch.arange(mask.shape[-1], device=mask.device)
    last = torch.where(valid, positions, 0).amax(-1, keepdim=True)
    score = torch.where(valid.any(-1), scores.float(), 0.0).unsqueeze(-1)
    return rewards.scatter_add(-1, last, score)


@torch.no_grad()
def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016): delta_t = r_t + gamma V_next - V_t,
    A_t = delta_t + gamma lam A_next, with V = 0 after the last response token. Returns
    (advantages, returns = advantages + values), both 0 off the mask. Unmasked positions between
    response tokens (tool or environment observations of a multi-turn rollout) are skipped: "next"
    is the next *masked* token, so their values and rewards never matter. No normalisation here."""
    valid = mask.bool()
    rewards, values = token_rewards.float(), values.float()
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(next_value)
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[-1])):
        here = valid[:, t]
        advantage = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_advantage
        advantages[:, t] = torch.where(here, advantage, 0.0)
        next_value = torch.where(here, values[:, t], next_value)
        next_advantage = torch.where(here, advantage, next_advantage)
    return advantages, torch.where(valid, advantages + values, 0.0)


@torch.no_grad()
def group_advantages(rewards: torch.Tensor, group_size: int, estimator: str, mask: torch.Tensor | None = None,
                     eps: float = 1e-6, baseline_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Sequence-level advantages, [N], for N samples laid out group after group (group_size answers
    per prompt). `mask` ([N]) marks the valid samples: an invalid one (unscored, filtered) gets 0 and
    enters no statistic.
    * grpo: (r - group mean) / (unbiased group std + eps) (Shao et al. 2024, DeepSeekMath);
    * dr_grpo: r - group mean (Liu et al. 2025, "Understanding R1-Zero-like training");
    * rloo: r - mean of the group's other valid samples (Ahmadian et al. 2024);
    * reinforce_pp: no group baseline, the batch whitened: (r - mean) / (population std + eps)
      (Hu 2025, REINFORCE++);
    * reinforce_pp_baseline: r - group mean, divided by the batch's population std (+ eps) of those
      centred values (REINFORCE++-baseline).
    A group with one valid sample, or whose valid rewards are all equal, gives 0 under the four
    group-baselined estimators (exactly, not a rounding residue over eps); its valid samples still
    count in reinforce_pp_baseline's batch std. The batch statistics are over the tensor passed in:
    hand the whole global batch for them to be global.
    `baseline_mask` ([N], grpo / dr_grpo / rloo): only these valid samples enter the group statistics
    (NeMo-Aligner's REINFORCE: samples that stopped on their own); the group's other valid samples
    get r - the mean of those (scaled by their std for grpo), or 0 when the group has none."""
    _check_choice("estimator", estimator, ADVANTAGE_ESTIMATORS)
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} samples do not split into groups of {group_size}")
    valid = torch.ones(rewards.numel(), dtype=torch.bool, device=rewards.device) if mask is None else mask.bool()
    valid = valid.reshape(-1, group_size)
    stats = valid
    if baseline_mask is not None:
        if estimator not in ("grpo", "dr_grpo", "rloo"):
            raise ValueError(f"baseline_mask applies to grpo, dr_grpo and rloo, not {estimator!r}")
        stats = valid & baseline_mask.bool().reshape(-1, group_size)
    r = torch.where(valid, rewards.float().reshape(-1, group_size), 0.0)
    count = stats.sum(-1, keepdim=True)
    n_valid = valid.sum().clamp(min=1)
    if estimator == "reinforce_pp":
        centred = torch.where(valid, r - r.sum() / n_valid, 0.0)
    else:
        in_stats = torch.where(stats, r, 0.0)
        centred = torch.where(valid & (count > 0), r - in_stats.sum(-1, keepdim=True) / count.clamp(min=1), 0.0)
        high = torch.where(stats, r, -torch.inf).amax(-1, keepdim=True)
        low = torch.where(stats, r, torch.inf).amin(-1, keepdim=True)
        degenerate = stats & ~((count > 1) & (high > low))
        centred = torch.where(degenerate, 0.0, centred)
    if estimator == "dr_grpo":
        advantages = centred
    elif estimator == "grpo":
        spread = torch.where(stats, centred, 0.0).pow(2).sum(-1, keepdim=True)
        advantages = centred / ((spread / (count - 1).clamp(min=1)).sqrt() + eps)
    elif estimator == "rloo":  # r - (S - r) / (k - 1) = k / (k - 1) * (r - S / k) for a sample in the baseline
        advantages = torch.where(stats, centred * count / (count - 1).clamp(min=1), centred)
    else:
        spread = torch.where(valid, centred - centred.sum() / n_valid, 0.0)
        advantages = centred / ((spread.pow(2).sum() / n_valid).sqrt() + eps)
    return advantages.reshape(-1)


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft over-long punishment (Yu et al. 2025, eq. 13), added to the reward: 0 up to
    max_new_tokens - buffer tokens, then falling linearly to -factor at max_new_tokens. buffer 0: off."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_new_tokens - buffer)).clamp(min=0)
    return -factor * (over / buffer).clamp(max=1.0)


def aggregate_loss(values: torch.Tensor, mask: torch.Tensor, mode: str, norm_length: int | None = None,
                   total_tokens: float | torch.Tensor | None = None,
                   total_sequences: float | torch.Tensor | None = None) -> torch.Tensor:
    """Reduce per-token losses [batch, seq] to a scalar. "Sequences" are the rows with at least one
    masked token (a fully masked, filtered sample does not dilute the mean).
    * token_mean: sum of masked values / number of masked tokens (DAPO, Yu et al. 2025);
    * seq_mean_token_mean: each sequence's mean over its tokens, then the mean over sequences (GRPO);
    * seq_mean_token_sum: each sequence's sum, then the mean over sequences;
    * seq_mean_token_sum_norm: sum over all masked tokens / (sequences * norm_length), norm_length
      defaulting to the padded length; Dr. GRPO passes max_new_tokens.
    Global batches: `total_tokens` / `total_sequences`, when given, replace the local denominators
    (this call's masked-token and sequence counts). Pass the counts of the whole global batch (every
    micro-batch on every data-parallel rank) and sum the pieces' losses: the result and its gradients
    then equal those of one call on the whole batch, however it is split."""
    _check_choice("aggregation", mode, LOSS_AGGREGATIONS)
    values = torch.where(mask.bool(), values.float(), 0.0)
    tokens = mask.float().sum(-1)
    if mode == "token_mean":
        return values.sum() / (tokens.sum().clamp(min=1) if total_tokens is None else total_tokens)
    sequences = (tokens > 0).sum().clamp(min=1) if total_sequences is None else total_sequences
    per_sequence = values.sum(-1)
    if mode == "seq_mean_token_mean":
        per_sequence = per_sequence / tokens.clamp(min=1)
    elif mode == "seq_mean_token_sum_norm":
        per_sequence = per_sequence / (values.shape[-1] if norm_length is None else norm_length)
    return per_sequence.sum() / sequences


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float = 0.2, clip_high: float | None = None, dual_clip: float | None = None,
                aggregation: str = "token_mean", ratio_level: str = "token", is_weights: torch.Tensor | None = None,
                norm_length: int | None = None, total_tokens: float | torch.Tensor | None = None,
                total_sequences: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate (Schulman et al. 2017), per token:
        max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high)),   rho = pi / pi_old,
    reduced by `aggregate_loss(.., aggregation, norm_length, total_tokens, total_sequences)`.
    `advantages` is [batch] (one per sequence) or [batch, seq]. clip_high defaults to clip_low; a
    larger one is DAPO's clip-higher (Yu et al. 2025). dual_clip = c > 1 caps the loss of negative
    advantages at -c A (Ye et al. 2020, "Mastering complex control in MOBA games"). ratio_level =
    "sequence": one ratio per sequence, exp of its mean token log-ratio (GSPO, Zheng et al. 2025;
    GSPO proper also takes aggregation="seq_mean_token_mean"). `is_weights` multiplies the per-token
    loss (truncated importance-sampling weights for a rollout/trainer mismatch; no grad).
    Metrics (detached, local masked-token means): clip_fraction (tokens where the clipped term won,
    so clipping zeroed the gradient), dual_clip_fraction (tokens capped by the dual clip),
    approx_kl (mean of (rho - 1) - log rho, token-level rho: k3 of KL(pi_old || pi)), ratio/mean."""
    _check_choice("ratio_level", ratio_level, RATIO_LEVELS)
    clip_high = clip_low if clip_high is None else clip_high
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    mask = mask.float()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.detach().float()
    # 0 off the mask, whatever the log-probs of padding hold: no inf ratio there to NaN the gradient
    token_log_ratio = torch.where(mask.bool(), logprobs.float() - old_logprobs.float(), 0.0)
    log_ratio = token_log_ratio
    if ratio_level == "sequence":
        log_ratio = token_log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = log_ratio.expand_as(token_log_ratio)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(mask, dtype=torch.bool)
    if dual_clip is not None:
        cap = -dual_clip * advantages
        dual_clipped = (advantages < 0) & (per_token > cap)
        per_token = torch.where(dual_clipped, cap, per_token)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = aggregate_loss(per_token, mask, aggregation, norm_length, total_tokens, total_sequences)
    with torch.no_grad():
        token_ratio = token_log_ratio.exp()
        metrics = {"clip_fraction": masked_mean((clipped > unclipped).float(), mask),
                   "dual_clip_fraction": masked_mean(dual_clipped.float(), mask),
                   "approx_kl": masked_mean(token_ratio - 1 - token_log_ratio, mask),
                   "ratio/mean": masked_mean(ratio, mask)}
    return loss, metrics


@torch.no_grad()
def adaptive_kl_coef(coef: float, kl: float, target: float, horizon: int, n_samples: int) -> float:
    """Ziegler et al. 2019's adaptive KL controller (also OpenRLHF's and TRL's PPO): with the step's KL
    (per sample, summed over its tokens) and e = clip(kl / target - 1, -0.2, 0.2), the next coefficient
    is coef x (1 + e x n_samples / horizon): it grows while the policy drifts past the target, shrinks below."""
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_samples / horizon)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var[returns - values] / Var[returns] over the masked tokens (population variances): 1 for
    a perfect critic, 0 for one that predicts the mean, negative for worse. 0.0 when Var[returns] is
    0 (nothing to explain), rather than NaN or inf."""
    valid = mask.bool()

    def variance(x):
        x = torch.where(valid, x.float(), 0.0)  # junk off the mask (NaN included) stays out
        return masked_mean((x - masked_mean(x, mask)).pow(2), mask)

    returns_variance = variance(returns)
    explained = 1 - variance(returns.float() - values.float()) / returns_variance
    return torch.where(returns_variance > 0, explained, 0.0)
