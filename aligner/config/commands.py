"""Every command's config: the YAML under conf/ and the dataclass schema it is checked against."""
from __future__ import annotations

from aligner.config.kd_schema import KDRunConfig
from aligner.config.rl_schema import PPORunConfig, RLRunConfig
from aligner.config.rs_schema import RSRunConfig
from aligner.config.schema import (CriticServeConfig, DPORunConfig, KTORunConfig, ORPORunConfig, RewardServeConfig,
                                   RMRunConfig, SFTRunConfig, SimPORunConfig, SPINRunConfig, SteerLMRunConfig,
                                   VerifierServeConfig)

# command name -> (yaml under conf/, schema)
COMMANDS = {"sft": ("sft", SFTRunConfig), "rm": ("rm", RMRunConfig),
            "serve_reward": ("serve_reward", RewardServeConfig), "serve_critic": ("serve_critic", CriticServeConfig),
            "serve_verifier": ("serve_verifier", VerifierServeConfig),
            "dpo": ("dpo", DPORunConfig), "orpo": ("orpo", ORPORunConfig), "simpo": ("simpo", SimPORunConfig),
            "kto": ("kto", KTORunConfig), "steerlm": ("steerlm", SteerLMRunConfig),
            "spin": ("spin", SPINRunConfig), "grpo": ("grpo", RLRunConfig), "reinforce": ("reinforce", RLRunConfig),
            "ppo": ("ppo", PPORunConfig), "rs": ("rs", RSRunConfig),
            "kd": ("kd", KDRunConfig)}
