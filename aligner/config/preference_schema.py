"""Schemas and cross-field rules of the preference family (aligner/algorithms/preference/): reward models,
SteerLM, DPO and its variants, SPIN, ORPO, SimPO and KTO. Each `validate_<name>(cfg)` runs after the rules
every training run shares (config/validate.py); config/registry.py names which one each command runs."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from omegaconf import MISSING

from aligner.config.generation_schema import GenerationBackendConfig, validate_generation_backend
from aligner.config.schema import (Overlong, PackableDataConfig, ReferenceConfig, SFTRunConfig,
                                   TrainRunConfig)
from aligner.errors import ConfigError


@dataclass
class SteerLMConfig:
    attributes: list[str] = MISSING  # the condition's attributes, in this order (saved with each checkpoint)
    scale: int = 4  # values are integers in [0, scale] (HelpSteer: 0..4)


@dataclass
class SteerLMRunConfig(SFTRunConfig):
    run_dir: str = "runs/steerlm"
    steerlm: SteerLMConfig = field(default_factory=SteerLMConfig)


class RMLoss(StrEnum):
    bt = "bt"  # Bradley-Terry on (chosen, rejected) pairs
    margin_bt = "margin_bt"  # Bradley-Terry with each pair's "margin" subtracted from the reward gap
    regression = "regression"  # masked MSE on per-attribute labels (HelpSteer / SteerLM)


@dataclass
class RewardModelConfig:
    loss: RMLoss = RMLoss.bt
    attributes: list[str] = field(default_factory=list)  # regression: one head output per attribute
    center_coef: float = 0.0  # pairs: + coef * (r_chosen + r_rejected)^2, each prompt's rewards centred on 0


@dataclass
class RMRunConfig(TrainRunConfig):
    run_dir: str = "runs/rm"
    data: PackableDataConfig = field(default_factory=PackableDataConfig)
    rm: RewardModelConfig = field(default_factory=RewardModelConfig)


# ---- preference pairs (aligner/algorithms/shared/sequence_trainer.py) ------------------------------------------------
@dataclass
class PreferenceDataConfig(PackableDataConfig):
    overlong: Overlong = Overlong.drop  # truncate keeps the start; needs a response token left


class DPOLossType(StrEnum):
    sigmoid = "sigmoid"  # DPO; with label_smoothing: conservative DPO (cDPO)
    robust = "robust"  # robust DPO under label noise label_smoothing
    hinge = "hinge"  # SLiC
    ipo = "ipo"  # (delta - 1/(2 beta))^2 on the summed (or averaged) log-ratios
    rpo_sq = "rpo_sq"  # reward-aware (NeMo-Aligner): needs chosen_reward / rejected_reward in the data
    rpo_fwd_kl = "rpo_fwd_kl"
    rpo_bwd_kl = "rpo_bwd_kl"


@dataclass
class DPOConfig:
    beta: float = 0.1  # KL penalty (the implicit reward is beta * log-ratio)
    loss_type: DPOLossType = DPOLossType.sigmoid
    label_smoothing: float = 0.0  # sigmoid / robust: assumed label-flip probability, in [0, 0.5)
    average_logprobs: bool = False  # length-average the response log-probs (else sum)
    reward_scale: float = 1.0  # rpo_*: scale of the data's reward difference
    sft_weight: float = 0.0  # weight of an NLL term on the chosen response


@dataclass
class DPORunConfig(TrainRunConfig):
    run_dir: str = "runs/dpo"
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)


@dataclass
class SPINConfig:
    steps_per_iteration: int = 10  # DPO steps on one iteration's pairs; trainer.max_steps sets the iterations
    greedy: bool = False  # the policy's generations: greedy, or sampled with temperature / top_p
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0
    generation_batch_size: int = 32  # prompts per generate call on each data-parallel replica


@dataclass
class SPINRunConfig(TrainRunConfig):
    run_dir: str = "runs/spin"
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    spin: SPINConfig = field(default_factory=SPINConfig)
    generation: GenerationBackendConfig = field(default_factory=GenerationBackendConfig)


@dataclass
class ORPOConfig:
    odds_ratio_weight: float = 0.1  # lambda: weight of the odds-ratio term next to the chosen NLL


@dataclass
class ORPORunConfig(TrainRunConfig):
    run_dir: str = "runs/orpo"
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    orpo: ORPOConfig = field(default_factory=ORPOConfig)


@dataclass
class SimPOConfig:
    beta: float = 2.0  # reward scale on the length-averaged log-probs
    gamma: float = 1.0  # target reward margin (absolute, not gamma / beta)
    label_smoothing: float = 0.0


@dataclass
class SimPORunConfig(TrainRunConfig):
    run_dir: str = "runs/simpo"
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    simpo: SimPOConfig = field(default_factory=SimPOConfig)


@dataclass
class KTOConfig:
    beta: float = 0.1
    desirable_weight: float = 1.0  # lambda_D
    undesirable_weight: float = 1.0  # lambda_U


@dataclass
class KTORunConfig(TrainRunConfig):
    run_dir: str = "runs/kto"
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    kto: KTOConfig = field(default_factory=KTOConfig)


def validate_steerlm(cfg) -> None:
    s = cfg.steerlm
    if not s.attributes or len(set(s.attributes)) != len(s.attributes):
        raise ConfigError(f"steerlm.attributes must name each attribute once, e.g. [helpfulness,verbosity]; "
                          f"got {list(s.attributes)}")
    if s.scale < 1:
        raise ConfigError(f"steerlm.scale must be >= 1 (values are integers in [0, scale]), got {s.scale}")


def validate_rm(cfg) -> None:
    loss = cfg.rm.loss
    if loss == "regression" and not cfg.rm.attributes:
        raise ConfigError("rm.loss=regression needs rm.attributes: the names of the labels to regress, e.g. "
                          "rm.attributes=[helpfulness,correctness]")
    if loss != "regression" and cfg.rm.attributes:
        raise ConfigError(f"rm.attributes is only used by rm.loss=regression (got rm.loss={loss})")
    if cfg.rm.center_coef < 0:
        raise ConfigError(f"rm.center_coef must be >= 0 (0 = off), got {cfg.rm.center_coef}")
    if loss == "regression" and cfg.rm.center_coef:
        raise ConfigError("rm.center_coef centres the rewards of preference pairs; rm.loss=regression has none")


def validate_dpo(cfg) -> None:
    loss, smoothing = cfg.dpo.loss_type, cfg.dpo.label_smoothing
    if smoothing and loss not in ("sigmoid", "robust"):
        raise ConfigError(f"dpo.label_smoothing applies to dpo.loss_type=sigmoid or robust, not {loss}")
    if not 0 <= smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing is a label-flip probability in [0, 0.5), got {smoothing}")


def validate_spin(cfg) -> None:
    """SPIN's own rules, then DPO's (its loss is DPO's)."""
    if cfg.spin.steps_per_iteration < 1 or cfg.spin.max_new_tokens < 1:
        raise ConfigError("spin.steps_per_iteration and spin.max_new_tokens must be >= 1")
    if cfg.reference.mode == "precompute":
        raise ConfigError("reference.mode=precompute does not apply to SPIN: its reference changes every "
                          "iteration; use reference.mode=model or cpu_swap")
    loss = cfg.dpo.loss_type
    if loss.startswith("rpo"):
        raise ConfigError(f"dpo.loss_type={loss} needs rewards in the data; SPIN's generated pairs have none")
    if cfg.model.context_parallel_size > 1:
        raise ConfigError("SPIN generates with the training model, and generation does not run under context "
                          "parallelism: set model.context_parallel_size=1")
    validate_generation_backend(cfg.generation.backend)
    validate_dpo(cfg)
