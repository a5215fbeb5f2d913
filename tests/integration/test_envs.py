"""The episode runner (aligner/envs/episodes.py) with the real tiny Megatron engine in this process, and the
environments' worker processes (aligner/envs/pool.py) and the python tool's sandbox.

Turns end early because a large set of stop tokens is given to the engine (the model is untrained, so its
eos is rare): each turn stops on its own within a few tokens, as a trained policy's would."""
import random
import time

import pytest

from aligner.envs import PythonTool
from aligner.envs.episodes import Renderer, run_episodes
from aligner.envs.pool import EnvironmentUnavailable, EnvPool
from tests.env_fixtures import Scripted

F = "tests.env_fixtures"
TOL = 1e-5


@pytest.fixture(scope="module")
def engine(tokenizer):
    """A 2-layer, hidden-64 GPT (random weights) and its MegatronEngine, on this process as a world of one."""
    from omegaconf import OmegaConf

    from aligner.config.schema import ModelConfig
    from aligner.generation.megatron_engine import MegatronEngine
    from aligner.models.gpt import build_gpt
    from aligner.runtime.seeding import seed_everything
    from tests.conftest import init_single_process

    init_single_process()
    seed_everything(5)
    cfg = OmegaConf.structured(ModelConfig)
    cfg.update(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, seq_length=256)
    model = build_gpt(cfg, len(tokenizer))
    model.eval()
    return MegatronEngine(model, cfg, len(tokenizer), eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)


def params(tokenizer, max_new_tokens=6):
    from aligner.generation.types import SamplingParams

    stops = tuple(range(100, len(tokenizer) - 12))  # ~400 of 512 ids: a turn stops within a few tokens
    return SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, stop_token_ids=stops, seed=0)


def prompts(tokenizer, n, seed=0):
    rng = random.Random(seed)
    texts = [f"What is {rng.randint(1, 99)}+{rng.randint(1, 99)}?" for _ in range(n)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=True, add_generation_prompt=True,
                                          return_dict=False) for t in texts]


def segments(mask):
    """(start, stop, kind) runs of equal mask values."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((start, i, mask[start]))
            start = i
    return runs


def test_token_in_token_out_over_random_episodes(engine, tokenizer):
    """16 random episodes (0-3 tool turns, awkward observations: role markers and eos as text, split bytes,
    edge spaces): each assistant run is exactly what the engine generates alone from the trajectory before it
    with the turn's seed (tokens equal, log-probs within 1e-5); each observation run is exactly the chat
    template's tokens of what a replayed environment returned for the decoded turns; masks 1 / 0 and
    log-probs 0 on observations; the score is the replay's reward, the transcript the replay's turns as text
    (the rollouts files' `turns`); a second run is bitwise the same and a
    reversed batch gives the same tokens. Decoding and re-encoding would have drifted on some of them."""
    from aligner.generation import rng

    n, p = 16, params(tokenizer)
    records = [{"prompt": "?", "seed": k, "tool_turns": random.Random(k).randint(0, 3)} for k in range(n)]
    ids = prompts(tokenizer, n)
    seeds = [rng.derive_seed(11, k) for k in range(n)]
    renderer = Renderer(tokenizer)
    with EnvPool(f"{F}:Scripted", concurrency=2, timeout_s=10) as pool:
        episodes, metrics = run_episodes(engine, tokenizer, ids, records, seeds, p, pool, max_turns=6,
                                         max_total_tokens=256)
        again, _ = run_episodes(engine, tokenizer, ids, records, seeds, p, pool, max_turns=6, max_total_tokens=256)
        backwards, _ = run_episodes(engine, tokenizer, ids[::-1], records[::-1], seeds[::-1], p, pool, max_turns=6,
                                    max_total_tokens=256)
    assert again == episodes
    assert [e.response_ids for e in backwards[::-1]] == [e.response_ids for e in episodes]
    drifted = 0
    for e, record, prompt in zip(episodes, records, ids):
        assert e.end == "env" and e.prompt_ids == prompt
        assert len(e.response_ids) == len(e.response_mask) == len(e.logprobs)
        replay = Scripted()
        replay.reset(record)
        turn, reward, transcript = 0, None, []
        for start, stop, kind in segments(e.response_mask):
            run = e.response_ids[start:stop]
            if kind == 1:
                alone = engine.generate([e.prompt_ids + e.response_ids[:start]], p,
                                        seeds=[rng.derive_seed(e.seed, turn)])
                assert alone.responses()[0] == run
                assert max(abs(a - b) for a, b in zip(alone.response_logprobs()[0], e.logprobs[start:stop])) <= TOL
                text = tokenizer.decode(run, skip_special_tokens=True)
                observation, reward, done = replay.step(text)
                transcript.append({"role": "assistant", "text": text, "reward": reward})
                turn += 1
            else:
                assert run == renderer.observation_ids(observation)
                assert e.logprobs[start:stop] == [0.0] * len(run)
                transcript += [{"role": "tool", "text": observation}] if isinstance(observation, str) else \
                    [{"role": m["role"], "text": m["content"]} for m in observation]
        assert done and e.score == reward and e.turns == turn == record["tool_turns"] + 1
        assert e.transcript == transcript  # the turns as text: what the environment got and gave, in order
        assert e.tool_calls == record["tool_turns"]
        full = e.prompt_ids + e.response_ids
        drifted += tokenizer(tokenizer.decode(full), add_special_tokens=False)["input_ids"] != full
    assert drifted >= 3, drifted  # the test has teeth: a decode -> encode trajectory would differ
    assert metrics["episode/turns_mean"] == sum(r["tool_turns"] + 1 for r in records) / n
    assert metrics["fraction/env_errors"] == 0 and metrics["fraction/max_turns_reached"] == 0


def test_max_turns_and_the_token_budget(engine, tokenizer):
    """Endless (an observation and reward 0.25 after every turn): max_turns=3 gives 3 turns, 2 tool calls and
    the score 0.75 in every episode; a budget of prompt + 12 tokens is never exceeded and ends every episode."""
    from aligner.generation import rng

    n, p = 6, params(tokenizer)
    ids, seeds = prompts(tokenizer, n, seed=1), [rng.derive_seed(3, k) for k in range(n)]
    with EnvPool(f"{F}:Endless", concurrency=2, timeout_s=10) as pool:
        episodes, metrics = run_episodes(engine, tokenizer, ids, [{}] * n, seeds, p, pool, max_turns=3,
                                         max_total_tokens=256)
        assert [(e.end, e.turns, e.tool_calls, e.score) for e in episodes] == [("max_turns", 3, 2, 0.75)] * n
        assert metrics["fraction/max_turns_reached"] == 1.0 and metrics["episode/tool_calls_mean"] == 2.0
        budget = max(len(i) for i in ids) + 12
        episodes, metrics = run_episodes(engine, tokenizer, ids, [{}] * n, seeds, p, pool, max_turns=50,
                                         max_total_tokens=budget)
    assert all(e.end == "max_total_tokens" and len(e.prompt_ids) + len(e.response_ids) <= budget for e in episodes)
    assert metrics["fraction/max_total_tokens_reached"] == 1.0
    assert all(sum(e.response_mask) >= 1 and e.score == 0.25 * e.turns for e in episodes)


def test_environment_failures_get_failure_reward_and_the_rest_go_on(engine, tokenizer):
    from aligner.generation import rng

    """Raises, hangs past the 1 s deadline, returns garbage, or raises in reset (the episode still has its first
    turn): failure_reward and counted; the other episodes finish, one of them on the prompt its reset gave."""
    modes = ["ok", "raise", "first", "hang", "garbage", "reset", "ok"]
    ids, seeds = prompts(tokenizer, len(modes), seed=2), [rng.derive_seed(4, k) for k in range(len(modes))]
    with EnvPool(f"{F}:Mixed", concurrency=3, timeout_s=1.0) as pool:
        episodes, metrics = run_episodes(engine, tokenizer, ids, [{"mode": m} for m in modes], seeds, params(tokenizer),
                                         pool, max_turns=4, max_total_tokens=256, failure_reward=-1.0)
    assert [e.end for e in episodes] == ["env", "env_error", "env", "env_error", "env_error", "env_error", "env"]
    assert [e.score for e in episodes] == [1.0, -1.0, 1.0, -1.0, -1.0, -1.0, 1.0]
    assert [e.turns for e in episodes] == [2, 1, 2, 1, 1, 1, 2]
    assert "ValueError: bad tool" in episodes[1].error and "deadline of 1 s" in episodes[3].error
    assert "reward 'one'" in episodes[4].error and "KeyError" in episodes[5].error
    assert tokenizer.decode(episodes[2].prompt_ids) == "<|user|>use the tool<eos><|assistant|>"
    assert metrics["fraction/env_errors"] == 4 / 7


@pytest.mark.solo
def test_eight_episodes_of_three_slow_turns_take_less_than_twice_one(engine, tokenizer):
    """Slow: 0.5 s of tool latency a turn, done at the third. Eight episodes at env.concurrency=8 against one."""
    from aligner.generation import rng

    p = params(tokenizer)
    ids, seeds = prompts(tokenizer, 8, seed=3), [rng.derive_seed(5, k) for k in range(8)]
    ratios = []
    with EnvPool(f"{F}:Slow", concurrency=8, timeout_s=10) as pool:
        for _ in range(3):  # the best of up to three tries: this shared 2-core machine's load comes and goes
            started = time.perf_counter()
            one, one_metrics = run_episodes(engine, tokenizer, ids[:1], [{}], seeds[:1], p, pool, max_turns=3,
                                            max_total_tokens=256)
            one_s = time.perf_counter() - started
            started = time.perf_counter()
            eight, metrics = run_episodes(engine, tokenizer, ids, [{}] * 8, seeds, p, pool, max_turns=3,
                                          max_total_tokens=256)
            eight_s = time.perf_counter() - started
            print(f"one episode {one_s:.2f} s (env {one_metrics['timing/env_s']:.2f} s), eight {eight_s:.2f} s (env "
                  f"{metrics['timing/env_s']:.2f} s): {eight_s / one_s:.2f}x")
            ratios.append(eight_s / one_s)
            assert [(e.end, e.turns, e.score) for e in one + eight] == [("env", 3, 1.0)] * 9
            assert one_s >= 1.5 and metrics["timing/env_s"] >= 1.5
            if ratios[-1] < 2:
                break
    assert min(ratios) < 2, ratios


def test_episode_samples_carry_the_mask_the_score_and_the_engines_log_probs(engine, tokenizer):
    """The RL hook (algorithms/online/multiturn.py): samples of Scripted episodes with token_mask, score and
    version; the trainer's forward over a whole multi-turn sequence gives the engine's log-probs at every
    engine token within 1e-5 (temperature 1, no filtering: the sampling distribution is the model's)."""
    import torch
    from omegaconf import OmegaConf

    from aligner.algorithms.online.multiturn import episode_samples, generate_episodes, scores_future, start_env_pool
    from aligner.data.prompts import Prompt
    from aligner.generation import rng

    n = 6
    cfg = OmegaConf.create({"env": {"name": f"{F}:Scripted", "max_turns": 5, "max_total_tokens": None,
                                    "timeout_s": 10.0, "concurrency": 2, "failure_reward": -1.0},
                            "reward": {"functions": [], "weights": None}})
    prompts_ = [Prompt(ids, "?", {"seed": 100 + k, "tool_turns": 2}, f"x:{k}")
                for k, ids in enumerate(prompts(tokenizer, n))]
    pool = start_env_pool(cfg)
    try:
        samples, metrics = episode_samples(engine, tokenizer, prompts_, [rng.derive_seed(9, k) for k in range(n)],
                                           params(tokenizer), cfg.env, pool, version=4, seq_length=256)
        # the trainer's generate: 2 episodes of each of 3 prompts, group after group, episode k seeded (seed, 7 + k)
        grouped, grouped_metrics = generate_episodes(engine, tokenizer, prompts_[:3], 2, 7, params(tokenizer),
                                                     cfg.env, pool, version=1, seq_length=256)
        alone, _ = episode_samples(engine, tokenizer, [prompts_[k // 2] for k in range(6)],
                                   [rng.derive_seed(0, 7 + k) for k in range(6)], params(tokenizer), cfg.env, pool,
                                   version=1, seq_length=256)
    finally:
        pool.close()
    assert [(s.prompt, s.response_ids, s.token_mask, s.score) for s in grouped] == \
        [(s.prompt, s.response_ids, s.token_mask, s.score) for s in alone]
    assert grouped_metrics["episode/turns_mean"] == 3 and grouped_metrics["timing/env_s"] > 0
    assert scores_future(grouped).result() == [s.score for s in alone]
    assert metrics["episode/turns_mean"] == 3 and metrics["episode/tool_calls_mean"] == 2
    worst = 0.0
    for sample in samples:
        mask = sample.response_token_mask()
        assert sample.version == 4 and 0 in mask and sample.score is not None and sample.valid
        assert sample.episode.turns == 3 and sample.episode.tool_calls == 2 and sample.episode.end == "env"
        assert [t["role"] for t in sample.episode.transcript].count("assistant") == 3
        ids = list(sample.prompt.ids) + sample.response_ids
        with torch.no_grad():
            logits = engine.gpt(torch.tensor([ids]), torch.arange(len(ids))[None], None)[0, :, :len(tokenizer)]
        logprobs = torch.log_softmax(logits.float(), -1)
        start = len(sample.prompt.ids)
        for j, (token, m) in enumerate(zip(sample.response_ids, mask)):
            if m:
                worst = max(worst, abs(logprobs[start + j - 1, token].item() - sample.engine_logprobs[j]))
            else:
                assert sample.engine_logprobs[j] == 0.0
    assert worst <= TOL, worst


def test_python_tool_runs_the_block_in_the_sandbox_and_truncates():
    env = PythonTool(rewards=["exact_match"], max_output_chars=20)
    env.reset({"prompt": "?", "answer": "42"})
    assert env.step("```python\nprint(6*7)\n```") == ("42\n", None, False)
    observation, reward, done = env.step("```python\nprint('x' * 100)\nimport sys; sys.stderr.write('oops')\n```")
    assert observation == "x" * 20 + "... [81 more characters]\nstderr: oops" and not done
    observation, _, _ = PythonTool(limits={"wall_s": 1.0}).step("```py\nwhile True: pass\n```")
    assert "timed out after 1 s" in observation
    assert env.step(" 42 ") == (None, 1.0, True)


def test_pool_failures_end_only_their_episode():
    """Raises, hangs (interruptible: the worker's alarm; stubborn: the host kills the worker), garbage: each
    call fails with why, the others succeed, and a killed worker is replaced."""
    with EnvPool(f"{F}:Raises", concurrency=2, timeout_s=0.5) as pool:
        assert pool.run([(0, "reset", {"fail_at": 1}), (1, "reset", {"fail_at": 2})]) == [(True, None)] * 2
        (ok0, why0), (ok1, obs1) = pool.run([(0, "step", "a"), (1, "step", "b")])
        assert not ok0 and why0 == "step raised RuntimeError: the tool broke"
        assert (ok1, obs1) == (True, ("fine", None, False))
    with EnvPool(f"{F}:Hangs", concurrency=2, timeout_s=0.5, grace_s=0.5) as pool:
        pool.run([(0, "reset", {}), (1, "reset", {"stubborn": True}), (3, "reset", {})])
        started = time.monotonic()
        results = pool.run([(0, "step", ""), (1, "step", "")])
        assert time.monotonic() - started < 15.0  # 0.5 s deadlines, a 0.5 s grace and a new worker's start
        assert results[0] == (False, "step ran past its deadline of 0.5 s (env.timeout_s)")
        assert not results[1][0] and "its worker process was killed" in results[1][1] and pool.restarts == 1
        # episode 3 shared the killed worker (3 mod 2 = 1): its environment is gone; worker 0 survived its alarm
        lost = "its environment was lost when a hung worker process was killed"
        assert pool.run([(3, "step", "")]) == [(False, lost)]
        assert pool.run([(2, "reset", {"hang_at": 2}), (2, "step", "")]) == [(True, None),
                                                                             (True, ("fine", None, False))]
    with EnvPool(f"{F}:Garbage", concurrency=1, timeout_s=5) as pool:
        kinds = ["tuple", "nan", "done", "observation", "message"]
        pool.run([(k, "reset", {"kind": kind}) for k, kind in enumerate(kinds)])
        results = pool.run([(k, "step", "") for k in range(len(kinds))])
        assert [ok for ok, _ in results] == [False] * len(kinds)
        assert all(why.startswith("step raised TypeError") for _, why in results), results


def test_the_python_tool_in_a_worker_process():
    with EnvPool("python", {"rewards": ["exact_match"]}, concurrency=1, timeout_s=20) as pool:
        assert pool.run([(0, "reset", {"prompt": "6*7?", "answer": "42"}), (0, "step", "```python\nprint(6*7)\n```"),
                         (0, "step", "42")]) == [(True, None), (True, ("42\n", None, False)), (True, (None, 1.0, True))]


def test_pool_refuses_a_class_that_cannot_be_built():
    with pytest.raises(EnvironmentUnavailable, match="cannot be constructed .RuntimeError: no tool here"):
        EnvPool(f"{F}:Unbuildable", concurrency=1)
    with pytest.raises(ValueError, match="unknown environment"):
        EnvPool("abacus")


