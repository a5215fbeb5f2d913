"""The preference and reward-model losses as pure tensor maths. No distributed calls, no model calls.
"""
from __future__ import annotations

import torch


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
