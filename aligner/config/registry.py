"""Every training algorithm, in one place. `aligner train NAME` composes conf/<conf>.yaml against `schema`,
checks it with the rules every training run shares (config/validate.py) and then with `validate`, and runs
`entry`: its `run(cfg)` in this process or its `main(argv)` in each launched rank. The CLI, the planner and
the report take their algorithm names from here.

The entry is a dotted module path, imported only when the algorithm runs: the config layer sits below the
algorithms and never imports them (and `aligner --help` never imports torch)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Mapping, Optional

from aligner.config.kd_schema import KDRunConfig, validate_kd
from aligner.config.preference_schema import (DPORunConfig, KTORunConfig, ORPORunConfig, RMRunConfig, SimPORunConfig,
                                              SPINRunConfig, SteerLMRunConfig, validate_dpo, validate_rm,
                                              validate_spin, validate_steerlm)
from aligner.config.rl_schema import PPORunConfig, RLRunConfig, validate_ppo, validate_rl
from aligner.config.rs_schema import RSRunConfig, validate_rs
from aligner.config.schema import (CriticServeConfig, RewardServeConfig, SFTRunConfig, TrainRunConfig,
                                   VerifierServeConfig)


@dataclass(frozen=True)
class Algorithm:
    entry: str  # the module with `run(cfg)` and `main(argv)`
    schema: type  # the run config's dataclass
    conf: str  # its YAML: conf/<conf>.yaml
    validate: Optional[Callable] = None  # its own cross-field rules: validate(cfg) raises ConfigError
    plannable: bool = False  # `aligner plan` models its memory and step time (aligner/plan)


PREFERENCE, ONLINE = "aligner.algorithms.preference", "aligner.algorithms.online"
ALGORITHMS: dict[str, Algorithm] = {
    "sft": Algorithm("aligner.algorithms.shared.sft", SFTRunConfig, "sft", plannable=True),
    "rm": Algorithm(f"{PREFERENCE}.reward_model", RMRunConfig, "rm", validate_rm, plannable=True),
    "dpo": Algorithm(f"{PREFERENCE}.dpo", DPORunConfig, "dpo", validate_dpo, plannable=True),
    "orpo": Algorithm(f"{PREFERENCE}.orpo", ORPORunConfig, "orpo", plannable=True),
    "simpo": Algorithm(f"{PREFERENCE}.simpo", SimPORunConfig, "simpo", plannable=True),
    "kto": Algorithm(f"{PREFERENCE}.kto", KTORunConfig, "kto", plannable=True),
    "steerlm": Algorithm(f"{PREFERENCE}.steerlm", SteerLMRunConfig, "steerlm", validate_steerlm, plannable=True),
    "spin": Algorithm(f"{PREFERENCE}.spin", SPINRunConfig, "spin", validate_spin),
    "grpo": Algorithm(f"{ONLINE}.grpo", RLRunConfig, "grpo", validate_rl, plannable=True),
    "reinforce": Algorithm(f"{ONLINE}.grpo", RLRunConfig, "reinforce", validate_rl, plannable=True),
    "ppo": Algorithm(f"{ONLINE}.ppo", PPORunConfig, "ppo", validate_ppo, plannable=True),
    "rs": Algorithm(f"{ONLINE}.rs", RSRunConfig, "rs", validate_rs),
    "kd": Algorithm("aligner.algorithms.distillation.kd", KDRunConfig, "kd", validate_kd),
}

# `aligner serve KIND`'s configs, by command name: (conf/<conf>.yaml, schema); their rules: aligner/servers/config.py
SERVE_CONFIGS: dict[str, tuple[str, type]] = {"serve_reward": ("serve_reward", RewardServeConfig),
                                              "serve_critic": ("serve_critic", CriticServeConfig),
                                              "serve_verifier": ("serve_verifier", VerifierServeConfig)}

# every command's config, by command name: (conf/<conf>.yaml, schema)
COMMAND_CONFIGS: dict[str, tuple[str, type]] = {**{name: (a.conf, a.schema) for name, a in ALGORITHMS.items()},
                                                **SERVE_CONFIGS}


def own_groups(schema: type) -> set[str]:
    """The config groups an algorithm adds to what every training run has (e.g. DPO: reference, dpo)."""
    return {f.name for f in fields(schema)} - {f.name for f in fields(TrainRunConfig)}


def algorithms_of(config: Mapping) -> list[str]:
    """The algorithms a saved run config (`<run_dir>/config.yaml`) may belong to: those with the most of
    their own groups in it, then the fewest missing (SPIN's config has DPO's groups too; a config written
    before a group existed lacks it). Several where their schemas are the same (grpo and reinforce)."""
    keys = set(config)
    fit = {name: (-len(own_groups(a.schema) & keys), len(own_groups(a.schema) - keys))
           for name, a in ALGORITHMS.items()}
    best = min(fit.values())
    return [name for name, score in fit.items() if score == best]
