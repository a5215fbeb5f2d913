"""Multi-turn episodes: the engine's turns and the environments' observations, token in, token out.

`run_episodes` advances a batch of episodes together, in rounds. Round k: one batched `engine.generate` of
the next assistant turn of every unfinished episode, then one `EnvPool.run` of their `step` calls
(concurrent, up to `env.concurrency`, each under `env.timeout_s`). Why rounds rather than generating for
whichever episodes are ready: a round's batch is the same in every run whatever the tools' timing, so an
episode's tokens reproduce bitwise (the engine's per-sample seeds already make them independent of the
batch, up to float rounding, which a fixed batch removes). The price: a round waits for its slowest tool
(bounded by the deadline).

The trajectory is exactly the engine's tokens, never decoded and re-encoded: each turn's response ids as
generated (its stop token included), then the observation's tokens, which are the chat template's text for
the observation after a finished assistant turn, with the generation prompt of the next one (the
difference between rendering a fixed conversation with and without the observation messages; text is
one `tool` message), encoded alone. Observation tokens have loss mask 0 and log-prob 0; assistant tokens
mask 1 and the engine's log-probs. The environment gets each turn as text (decoded, special tokens
skipped); that text never enters the trajectory. An episode also keeps its turns as text (`transcript`: each
assistant turn as the environment got it, with the reward it gave for it, and each appended observation's
messages), for the rollouts files and the report; its `Summary` is what a sample keeps of it.

Turn k of an episode is seeded with `derive_seed(episode seed, k)`. An episode ends when the environment
says done, when it fails (raises, overruns its deadline, returns garbage: `failure_reward`), at `max_turns`
assistant turns, when its prompt + response reach `max_total_tokens` (a turn is cut there, an observation
that would not leave room for one more token is not appended), or after a turn cut by
`SamplingParams.max_new_tokens` (its environment still gets it: a cut final answer is still scored). Its
score is the sum of the rewards the environment gave; None when the environment ended it without one (an
unscored sample), 0.0 when it gave none and the runner ended it (turns or tokens ran out).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from aligner.data.sft import encode_text, render_chat
from aligner.envs.pool import EnvPool
from aligner.generation import rng
from aligner.generation.types import GenerationBackend, SamplingParams

ENDS = ("env", "env_error", "max_turns", "max_total_tokens", "length")


@dataclass
class Episode:
    prompt_ids: list[int]
    seed: int
    response_ids: list[int] = field(default_factory=list)  # every turn and observation after the prompt
    response_mask: list[int] = field(default_factory=list)  # 1 on the engine's tokens, 0 on observations
    logprobs: list[float] = field(default_factory=list)  # the engine's log q per response token (0: observation)
    rewards: list[float] = field(default_factory=list)  # as the environment gave them
    turns: int = 0  # assistant turns
    tool_calls: int = 0  # observations appended
    is_end: bool = True  # its last turn stopped on its own (not cut)
    end: str = ""  # one of ENDS
    error: str = ""  # why the environment failed
    score: Optional[float] = None
    # the turns as text: {"role": "assistant", "text", "reward" (None: none given)}, then the appended
    # observation's messages {"role", "text"} ("tool" for a text observation)
    transcript: list[dict] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return bool(self.end)

    def summary(self) -> Summary:
        return Summary(self.turns, self.tool_calls, self.end, self.error, self.transcript)


@dataclass
class Summary:
    """What a sample keeps of its episode besides the tokens: the step's episode metrics and the report read it."""
    turns: int
    tool_calls: int
    end: str
    error: str
    transcript: list[dict]


class Renderer:
    """Token ids of observations and first prompts through the tokenizer's chat template (module doc)."""

    BASE = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "."}]

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.base = render_chat(tokenizer, self.BASE)

    def observation_ids(self, observation) -> list[int]:
        messages = [{"role": "tool", "content": observation}] if isinstance(observation, str) \
            else list(observation or [])
        text = render_chat(self.tokenizer, self.BASE + messages, generation_prompt=True)
        if not text.startswith(self.base):
            raise ValueError("the chat template renders a conversation differently once an observation follows it; "
                             "observations cannot be appended token by token")
        return encode_text(self.tokenizer, text[len(self.base):])

    def prompt_ids(self, observation) -> list[int]:
        messages = [{"role": "user", "content": observation}] if isinstance(observation, str) else list(observation)
        return encode_text(self.tokenizer, render_chat(self.tokenizer, messages, generation_prompt=True))


def _end(episode: Episode, end: str, failure_reward: float, error: str = "") -> None:
    episode.end, episode.error = end, error
    if end == "env_error":
        episode.score = float(failure_reward)
    elif episode.rewards:
        episode.score = float(sum(episode.rewards))
    else:
        episode.score = None if end == "env" else 0.0


def run_episodes(engine: GenerationBackend, tokenizer, prompt_ids: Sequence[Sequence[int]], records: Sequence[dict],
                 seeds: Sequence[int], params: SamplingParams, pool: EnvPool | None, *, max_turns: int,
                 max_total_tokens: int, failure_reward: float = 0.0,
                 share: Callable[[object], object] | None = None) -> tuple[list[Episode], dict]:
    """The episodes of `prompt_ids[i]` (with `records[i]` for `reset` and `seeds[i]`), and their metrics.

    `engine.generate` is called on every rank given (collective over the engine's model-parallel group);
    the environments run on the rank whose `pool` is not None, and `share(results or None)` gives every rank
    that rank's results (a broadcast over the model-parallel group; None: this rank is the only one)."""
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if not len(prompt_ids) == len(records) == len(seeds):
        raise ValueError(f"{len(prompt_ids)} prompts, {len(records)} records and {len(seeds)} seeds")
    renderer = Renderer(tokenizer)
    episodes = [Episode(list(map(int, ids)), int(seed)) for ids, seed in zip(prompt_ids, seeds)]
    env_s = 0.0

    def call(calls):
        nonlocal env_s
        started = time.perf_counter()
        results = pool.run(calls) if pool is not None else None
        results = share(results) if share is not None else results
        env_s += time.perf_counter() - started
        return results

    failed_at_reset = {}
    if pool is not None:
        pool.clear()
    for k, (ok, value) in enumerate(call([(k, "reset", dict(r)) for k, r in enumerate(records)])):
        if not ok:
            failed_at_reset[k] = value  # it still generates its first turn, so that its response is not empty
        elif value is not None:
            episodes[k].prompt_ids = renderer.prompt_ids(value)
    for turn in range(max_turns):
        for e in episodes:
            if not e.done and len(e.prompt_ids) + len(e.response_ids) >= max_total_tokens:
                _end(e, "max_total_tokens", failure_reward)
        active = [k for k, e in enumerate(episodes) if not e.done]
        if not active:
            break
        room = [max_total_tokens - len(episodes[k].prompt_ids) - len(episodes[k].response_ids) for k in active]
        most = min(params.max_new_tokens, max(room))
        rollout = engine.generate([episodes[k].prompt_ids + episodes[k].response_ids for k in active],
                                  params.replace(max_new_tokens=most, min_new_tokens=min(params.min_new_tokens, most)),
                                  seeds=[rng.derive_seed(episodes[k].seed, turn) for k in active])
        actions = []
        for k, left, ids, logprobs, ended in zip(active, room, rollout.responses(), rollout.response_logprobs(),
                                                 rollout.is_end.tolist()):
            e = episodes[k]
            keep = min(len(ids), left)  # a turn past this episode's own token budget is cut there
            e.response_ids += ids[:keep]
            e.response_mask += [1] * keep
            e.logprobs += [float(x) for x in logprobs[:keep]]
            e.turns += 1
            e.is_end = bool(ended) and keep == len(ids)
            actions.append(tokenizer.decode(ids[:keep], skip_special_tokens=True))
            e.transcript.append({"role": "assistant", "text": actions[-1], "reward": None})
        stepping = []
        for k, action in zip(active, actions):
            if k in failed_at_reset:
                _end(episodes[k], "env_error", failure_reward, failed_at_reset[k])
            else:
                stepping.append((k, action))
        for (k, _), (ok, value) in zip(stepping, call([(k, "step", action) for k, action in stepping])):
            e = episodes[k]
            if not ok:
                _end(e, "env_error", failure_reward, value)
                continue
            observation, reward, done = value
            if reward is not None:
                e.rewards.append(reward)
                e.transcript[-1]["reward"] = reward
            if done:
                _end(e, "env", failure_reward)
            elif not e.is_end:
                _end(e, "max_total_tokens" if len(e.prompt_ids) + len(e.response_ids) >= max_total_tokens
                     else "length", failure_reward)
            elif e.turns >= max_turns:
                _end(e, "max_turns", failure_reward)
            else:
                try:
                    ids = renderer.observation_ids(observation)
                except Exception as error:  # noqa: BLE001 - a template that cannot render it: the env's failure
                    _end(e, "env_error", failure_reward, f"its observation cannot be rendered ({error})")
                    continue
                if len(e.prompt_ids) + len(e.response_ids) + len(ids) >= max_total_tokens:
                    _end(e, "max_total_tokens", failure_reward)  # no room for a turn after it
                    continue
                e.response_ids += ids
                e.response_mask += [0] * len(ids)
                e.logprobs += [0.0] * len(ids)
                e.tool_calls += observation is not None
                e.transcript += [{"role": "tool", "text": observation}] if isinstance(observation, str) else \
                    [{"role": str(m.get("role")), "text": str(m.get("content"))} for m in observation or []]
    for e in episodes:  # rounds ran out: only when every episode ended or max_turns was reached
        if not e.done:
            _end(e, "max_turns", failure_reward)
    return episodes, episode_metrics(episodes, env_s)


def episode_metrics(episodes: Sequence[Episode | Summary], env_s: float) -> dict:
    """The episodes' turns, tool calls and ends (`episode/*`, `fraction/*`), and `timing/env_s`."""
    n = max(len(episodes), 1)
    return {"episode/turns_mean": statistics.fmean(e.turns for e in episodes) if episodes else 0.0,
            "episode/tool_calls_mean": statistics.fmean(e.tool_calls for e in episodes) if episodes else 0.0,
            "fraction/env_errors": sum(e.end == "env_error" for e in episodes) / n,
            "fraction/max_turns_reached": sum(e.end == "max_turns" for e in episodes) / n,
            "fraction/max_total_tokens_reached": sum(e.end == "max_total_tokens" for e in episodes) / n,
            "timing/env_s": env_s}
