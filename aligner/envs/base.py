"""The environment contract of multi-turn rollouts, and what every environment shares.

An episode: `reset(record)` once, then `step(action)` after every assistant turn until it says done.
* `record` is the prompt record: `{"prompt": text or messages, **fields}` (`answer`, `tests`, ...).
* `reset` returns the first observation, or None to keep the prompt as the dataset tokenized it (the
  built-ins do). An observation is text (one `tool` message) or a list of `{"role", "content"}` messages.
* `step(action_text)` gets the assistant turn's text and returns `(observation or None, reward or None,
  done)`. A reward is a finite number; an episode's rewards are summed. After `done` no call follows.

Every method runs in a worker process of `aligner.envs.pool.EnvPool` under a per-call deadline; one that
raises, overruns the deadline or returns anything else than the above ends its episode with
`env.failure_reward`.

`Environment.__init__(rewards, weights)` takes the run's reward functions (names as in `reward.functions`,
`aligner.rewards.functions`); `score` is their weighted sum on a final answer (None when any is unscored),
which is how the built-ins score the answer that ends an episode. A custom class may ignore them.
"""
from __future__ import annotations

import math
import numbers
from typing import Sequence, Union

from aligner.rewards.functions import call_reward, resolve_reward_functions

Observation = Union[str, list]  # text (one tool message) or [{"role": str, "content": str}, ...]


class Environment:
    """Base class of environments (see the module doc); subclasses implement `reset` and `step`."""

    def __init__(self, rewards: Sequence[str] = (), weights: Sequence[float] | None = None):
        self.reward_functions = resolve_reward_functions(list(rewards))
        self.weights = [1.0] * len(self.reward_functions) if weights is None else [float(w) for w in weights]
        if len(self.weights) != len(self.reward_functions):
            raise ValueError(f"{len(self.weights)} weights for {len(self.reward_functions)} reward functions")
        self.record: dict = {}

    def reset(self, record: dict) -> Observation | None:
        raise NotImplementedError

    def step(self, action: str) -> tuple[Observation | None, float | None, bool]:
        raise NotImplementedError

    def score(self, answer: str) -> float | None:
        """The reward functions' weighted sum on `answer` for the record of `reset`; None when any cannot
        score it (or there are none)."""
        if not self.reward_functions:
            return None
        fields = {k: v for k, v in self.record.items() if k != "prompt"}
        prompt = self.record.get("prompt")
        total = 0.0
        for fn, weight in zip(self.reward_functions, self.weights):
            value, _ = call_reward(fn, prompt if isinstance(prompt, str) else str(prompt), answer, fields)
            if value is None:
                return None
            total += weight * value
        return total


def check_observation(value, where: str) -> Observation | None:
    """`value` if it is a valid observation (or None); raises TypeError naming `where` otherwise."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and set(m) == {"role", "content"}
                                       and isinstance(m["role"], str) and isinstance(m["content"], str)
                                       for m in value):
        return [dict(m) for m in value]
    raise TypeError(f"{where} returned the observation {str(value)[:200]!r}; expected None, text or a list of "
                    f"{{'role': str, 'content': str}} messages")


def check_step(value) -> tuple[Observation | None, float | None, bool]:
    """A `step` result checked (see the module doc); raises TypeError saying what is wrong."""
    if not isinstance(value, tuple) or len(value) != 3:
        raise TypeError(f"step returned {str(value)[:200]!r}; expected (observation or None, reward or None, done)")
    observation, reward, done = value
    observation = check_observation(observation, "step")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, numbers.Real)
                               or not math.isfinite(reward)):
        raise TypeError(f"step returned the reward {reward!r}; expected None or a finite number")
    if not isinstance(done, bool):
        raise TypeError(f"step returned done={done!r}; expected True or False")
    return observation, None if reward is None else float(reward), done
