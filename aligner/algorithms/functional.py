"""Pure tensor maths for every algorithm. No distributed calls, no model calls.

Conventions: `mask` is 1.0 for tokens that count and 0.0 otherwise; token tensors are [batch, seq].
"""
from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of `values` where `mask` is 1 (float32 accumulation)."""
    return (values.float() * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked tokens; 0 when the mask is empty (nothing to average, no NaN)."""
    return masked_sum(values, mask) / mask.sum().clamp(min=1)


def token_nll_sum(token_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed negative log-likelihood of the masked tokens. The trainer divides by the number of
    loss tokens in the whole global batch, so the loss is a per-token mean that does not depend on
    the micro-batch or data-parallel split (NeMo-RL's convention)."""
    return -masked_sum(token_logprobs, mask)


# ---- preference optimisation ------------------------------------------------------------------------
# Inputs are per-sequence log-probabilities of the response tokens, 1-D tensors with one entry per
# pair (or per sample for KTO): log pi(y|x) summed over the response, or averaged over its tokens
# when the caller length-normalises. Every function returns the per-sample loss (1-D); callers sum
# it and divide by the global number of pairs. "Log-ratio margin" means
#     delta = (log pi(y_c|x) - log ref(y_c|x)) - (log pi(y_r|x) - log ref(y_r|x))   (no beta in it).
DPO_LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo", "rpo_sq", "rpo_fwd_kl", "rpo_bwd_kl")


def preference_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """1 where chosen > rejected, 0 where it is lower, 1/2 on a tie (so a policy equal to its
    reference scores chance, 0.5, rather than 0)."""
    return (chosen > rejected).float() + 0.5 * (chosen == rejected).float()


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
             chosen_rewards: torch.Tensor | None = None, rejected_rewards: torch.Tensor | None = None,
             reward_scale: float = 1.0) -> torch.Tensor:
    """Per-pair loss of the DPO family, on the log-ratio margin `delta` (see above); `eps` =
    `label_smoothing`, `g = reward_scale * (chosen_rewards - rejected_rewards)` for the rpo types.

    * sigmoid: -(1 - eps) log s(beta delta) - eps log s(-beta delta). eps = 0 is DPO (Rafailov et al.
      2023, eq. 7); eps > 0 is conservative DPO (cDPO, Mitchell 2023): labels flipped with probability eps.
      ln 2 when the policy equals the reference.
    * robust: [-(1 - eps) log s(beta delta) + eps log s(-beta delta)] / (1 - 2 eps), the unbiased
      estimator under label noise eps (Chowdhury et al. 2024, "Provably robust DPO").
    * hinge: max(0, 1 - beta delta) (SLiC-HF, Zhao et al. 2023).
    * ipo: (delta - 1 / (2 beta))^2 (Azar et al. 2023). Like NeMo-Aligner and OpenRLHF, delta is
      taken on whatever log-probs are passed: summed ones by default, while the IPO paper averages
      over tokens (pass length-averaged log-probs for that).
    * rpo_sq, rpo_fwd_kl, rpo_bwd_kl: reward-aware preference optimisation (Nemotron-4 340B report,
      Adler et al. 2024), with NeMo-Aligner's definitions. With p = s(beta delta), the policy's
      implied probability that chosen wins, and q = s(g), the one the rewards imply:
      rpo_sq = (beta delta - g)^2;
      rpo_bwd_kl = q log(q/p) + (1-q) log((1-q)/(1-p))   [KL(q || p)];
      rpo_fwd_kl = p log(p/q) + (1-p) log((1-p)/(1-q))   [KL(p || q)].
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(DPO_LOSS_TYPES)}, got {loss_type!r}")
    if label_smoothing and loss_type not in ("sigmoid", "robust"):
        raise ValueError(f"label_smoothing applies to the sigmoid and robust losses, not {loss_type!r}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    delta = (policy_chosen_logps - ref_chosen_logps) - (policy_rejected_logps - ref_rejected_logps)
    logits = beta * delta
    logsigmoid = torch.nn.functional.logsigmoid
    if loss_type == "sigmoid":
        return -(1 - label_smoothing) * logsigmoid(logits) - label_smoothing * logsigmoid(-logits)
    if loss_type == "robust":
        return (-(1 - label_smoothing) * logsigmoid(logits) + label_smoothing * logsigmoid(-logits)) / (
            1 - 2 * label_smoothing)
    if loss_type == "hinge":
        return torch.relu(1 - logits)
    if loss_type == "ipo":
        return (delta - 1 / (2 * beta)) ** 2
    if chosen_rewards is None or rejected_rewards is None:
        raise ValueError(f"loss_type={loss_type!r} needs chosen_rewards and rejected_rewards")
    target = reward_scale * (chosen_rewards - rejected_rewards)
    if loss_type == "rpo_sq":
        return (logits - target) ** 2
    log_p, log_1mp = logsigmoid(logits), logsigmoid(-logits)
    log_q, log_1mq = logsigmoid(target), logsigmoid(-target)
    if loss_type == "rpo_bwd_kl":
        return log_q.exp() * (log_q - log_p) + log_1mq.exp() * (log_1mq - log_1mp)
    return log_p.exp() * (log_p - log_q) + log_1mp.exp() * (log_1mp - log_1mq)


def log_odds(mean_logps: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) for p = exp(mean_logps), computed as x - log(-expm1(x)) with x capped at
    -1e-6: a mean log-prob that rounds to 0 (p = 1 in float32) would otherwise give an infinite odds."""
    x = mean_logps.clamp(max=-1e-6)
    return x - torch.log(-torch.expm1(x))


def orpo_loss(chosen_mean_logps: torch.Tensor, rejected_mean_logps: torch.Tensor,
              odds_ratio_weight: float) -> torch.Tensor:
    """ORPO (Hong et al. 2024, eqs. 6-7), reference-free, on length-averaged log-probs:
    -mean log pi(y_c|x) - lambda log s(log odds(y_c) - log odds(y_r)), with lambda = `odds_ratio_weight`
    and odds(y) = p / (1 - p), p = exp(mean log-prob). The NLL term is averaged per sequence (each
    pair weighs the same), where the paper's implementation averages over the batch's tokens."""
    ratio = torch.nn.functional.logsigmoid(log_odds(chosen_mean_logps) - log_odds(rejected_mean_logps))
    return -chosen_mean_logps - odds_ratio_weight * ratio


def simpo_loss(chosen_mean_logps: torch.Tensor, rejected_mean_logps: torch.Tensor, beta: float, gamma: float,
               label_smoothing: float = 0.0) -> torch.Tensor:
    """SimPO (Meng et al. 2024, eq. 6), reference-free, on length-averaged log-probs:
    -(1 - eps) log s(beta (c - r) - gamma) - eps log s(-(beta (c - r) - gamma)), where gamma is the
    target reward margin (the paper's gamma, not gamma / beta) and eps the label smoothing."""
    logits = beta * (chosen_mean_logps - rejected_mean_logps) - gamma
    logsigmoid = torch.nn.functional.logsigmoid
    return -(1 - label_smoothing) * logsigmoid(logits) - label_smoothing * logsigmoid(-logits)


def kto_kl_estimate(logratio_sum: torch.Tensor, count: int | float) -> torch.Tensor:
    """KTO's reference point z0 = max(0, mean over the batch of log pi(y'|x) - log ref(y'|x)) for
    mismatched pairs (x, y') (Ethayarajh et al. 2024, sec. 4.1). Takes the sum of the log-ratios over
    the batch (so that a caller can all-reduce it first) and the batch size; returns a detached scalar."""
    return (logratio_sum / max(count, 1)).clamp(min=0).detach()


def kto_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor,
             beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> torch.Tensor:
    """Per-sample KTO loss (Ethayarajh et al. 2024, eq. 8), with r = log pi(y|x) - log ref(y|x) and
    the reference point z0 = `kl` (a detached scalar, see `kto_kl_estimate`):
    desirable:   lambda_D (1 - s(beta (r - z0)));   undesirable: lambda_U (1 - s(beta (z0 - r))).
    `desirable` is a bool tensor. The constant lambda offset of the paper's value function is dropped
    (it has no gradient); a policy equal to its reference (r = 0, z0 = 0) scores lambda / 2."""
    r = policy_logps - ref_logps
    return torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (r - kl))),
                       undesirable_weight * (1 - torch.sigmoid(beta * (kl - r))))


# ---- reward models and critics -----------------------------------------------------------------------
def bradley_terry_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                       margins: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pair Bradley-Terry loss -log sigmoid(r_c - r_r) on 1-D reward tensors. With `margins`
    this is margin-BT (Llama 2, Touvron et al. 2023, eq. 2): -log sigmoid(r_c - r_r - m)."""
    delta = chosen_rewards - rejected_rewards
    return -torch.nn.functional.logsigmoid(delta if margins is None else delta - margins)


def reward_centering_penalty(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> torch.Tensor:
    """Per-pair (r_c + r_r)^2: zero when the pair's rewards are centred on 0 (Eisenstein et al. 2023)."""
    return (chosen_rewards + rejected_rewards).pow(2)


def masked_squared_error(predicted: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(predicted - label)^2 where `mask` is 1, exactly 0 elsewhere (an unlabelled attribute may hold
    any placeholder, even NaN). All [batch, attributes] (SteerLM / HelpSteer regression RMs)."""
    return torch.where(mask.bool(), (predicted - labels).pow(2), torch.zeros_like(predicted))


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
