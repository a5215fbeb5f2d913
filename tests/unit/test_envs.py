"""aligner.envs, the in-process pieces: the calculator, `env.name` resolution, the checks of step results, and
the chat-template rendering of observations (the tiny tokenizer). Worker processes, the sandbox and the episode
runner: tests/integration/test_envs.py."""
import pytest

from aligner.envs import Calculator, PythonTool, resolve_environment
from aligner.envs.base import check_step
from aligner.envs.episodes import Renderer
from aligner.envs.tools import calculate, calculator_call

F = "tests.env_fixtures"


def test_calculator_evaluates_arithmetic_and_refuses_the_rest():
    assert calculate("12*(3+4) - 5") == "79"
    assert calculate("7/2") == "3.5" and calculate("8/2") == "4" and calculate("-2**3") == "-8"
    assert calculate("1/0").startswith("error: ZeroDivisionError")
    assert calculate("__import__('os')").startswith("error: ValueError")
    assert calculate("2**10**9").startswith("error: ValueError: exponent")


def test_calculator_episode_scored_by_the_reward_functions():
    env = Calculator(rewards=["arithmetic"])
    assert env.reset({"prompt": "What is 123*45?", "answer": "5535"}) is None
    assert env.step("let me see <calc>123*45</calc>") == ("5535", None, False)
    assert env.step("The answer is 5535") == (None, 1.0, True)
    env.reset({"prompt": "?", "answer": "5535"})
    assert env.step("5536") == (None, 0.0, True)
    assert Calculator().step("no reward functions") == (None, None, True)  # unscored, not 0


def test_calculator_call_scores_the_first_call_of_an_episode():
    """reward.val_functions=[aligner.envs.tools:calculator_call]: the tiny example's tool-use success."""
    episode = "<calc>47*58</calc><|tool|>27262726"  # a decoded episode: the call, the tool turn, the answer
    assert calculator_call("?", episode, answer="2726") == 1.0
    assert calculator_call("?", "<calc>58 * 47</calc>2726", answer=2726) == 1.0  # any expression of that value
    assert calculator_call("?", "<calc>47*85</calc>3995<calc>47*58</calc>2726", answer="2726") == 0.0  # the first
    assert calculator_call("?", "2726", answer="2726") == 0.0  # answered without the calculator
    assert calculator_call("?", "<calc>47*</calc>", answer="2726") == 0.0 and calculator_call("?", episode) is None
    assert calculator_call("?", "<calc>x</calc>", answer="x") == 0.0  # an error never matches


def test_resolution_by_name_and_the_bad_names():
    assert resolve_environment("python") is PythonTool and resolve_environment("calculator") is Calculator
    assert resolve_environment(f"{F}:Slow").__name__ == "Slow"
    for name, says in (("abacus", "unknown environment 'abacus'"), (f"{F}:Nope", "cannot be loaded"),
                       (f"{F}:NoStep", "a class without step"), (f"{F}:AWKWARD", "a list, not a class"),
                       ("no_such_module:X", "cannot be loaded (ModuleNotFoundError")):
        with pytest.raises(ValueError, match=says.replace("(", r"\(")):
            resolve_environment(name)


def test_step_results_are_checked():
    assert check_step(("obs", 1, False)) == ("obs", 1.0, False)
    assert check_step(([{"role": "tool", "content": "x"}], None, True))[0] == [{"role": "tool", "content": "x"}]
    for bad, says in ((("x", 1.0), "expected"), (("x", float("inf"), False), "finite"), (("x", True, False), "finite"),
                      (("x", None, 1), "done"), ((3, None, False), "observation"),
                      (([{"role": "tool"}], None, False), "observation")):
        with pytest.raises(TypeError, match=says):
            check_step(bad)


def test_observations_render_with_the_chat_template(tokenizer):
    renderer = Renderer(tokenizer)
    expected = tokenizer("<|tool|>4 <eos><|assistant|>", add_special_tokens=False)["input_ids"]
    assert renderer.observation_ids("4 ") == expected
    assert tokenizer.decode(renderer.observation_ids([{"role": "tool", "content": "a"}, {"role": "system",
                                                                                        "content": "b"}])) \
        == "<|tool|>a<eos><|system|>b<eos><|assistant|>"
    assert renderer.observation_ids(None) == [tokenizer.convert_tokens_to_ids("<|assistant|>")]
    assert tokenizer.decode(renderer.prompt_ids("hi")) == "<|user|>hi<eos><|assistant|>"


GRPO = ["data.train_path=prompts.jsonl", "tokenizer.path=tok", "model.pretrained=null", "reward.functions=[arithmetic]"]


@pytest.mark.parametrize("overrides, fragment", [
    (["env.name=calculator", "env.max_turns=0"], r"env.max_turns must be >= 1"),
    (["env.max_turns=-1"], r"env.max_turns must be >= 1"),
    (["env.name=calculator", "env.concurrency=0"], r"env.concurrency >= 1"),
    (["env.name=calculator", "env.timeout_s=0"], r"env.timeout_s must be > 0"),
    (["env.name=calculator", "env.max_total_tokens=100000"],
     r"env.max_total_tokens=100000 must .* fit model.seq_length"),
    (["env.name=calculator", "algorithm.overlong.buffer=4"], r"algorithm.overlong.buffer=0 with env.name"),
    (["env.max_turnz=2"], r"max_turnz"),
])
def test_env_settings_that_cannot_run_are_refused_in_one_line(overrides, fragment):
    from aligner.config import load_config
    from aligner.errors import ConfigError

    with pytest.raises(ConfigError, match=fragment) as error:
        load_config("grpo", GRPO + overrides, world_size=1)
    assert "\n" not in str(error.value)


def test_an_environment_composes_with_separate_rollout_workers():
    from aligner.config import load_config

    cfg = load_config("grpo", GRPO + ["env.name=calculator", "generation.placement=separate",
                                      "algorithm.async.max_lag=1"], world_size=1)
    assert cfg.env.name == "calculator" and cfg.generation.placement == "separate"


def test_ppo_refuses_an_environment():
    from aligner.config import load_config
    from aligner.errors import ConfigError

    with pytest.raises(ConfigError, match="PPO's critic does not value them yet"):
        load_config("ppo", GRPO + ["env.name=calculator", "reward.checkpoint=rm"], world_size=1)


def test_env_defaults_are_single_turn():
    from aligner.config import load_config

    cfg = load_config("grpo", GRPO, world_size=1)
    assert cfg.env.name is None and cfg.env.max_turns == 4 and cfg.env.concurrency == 8
    assert load_config("reinforce", GRPO + ["env.name=python", "env.max_turns=3"], world_size=1).env.max_turns == 3


@pytest.mark.parametrize("name, fragment", [
    ("abacus", "unknown environment 'abacus'"), (f"{F}:NoStep", "a class without step"),
])
def test_the_cli_resolves_env_name_before_launch(name, fragment):
    from aligner.cli import _check_rl_inputs
    from aligner.config import load_config
    from aligner.errors import UsageError

    cfg = load_config("grpo", GRPO + [f"env.name={name}"], world_size=1)
    with pytest.raises(UsageError, match=fragment) as error:
        _check_rl_inputs(cfg)
    assert "env.name" in str(error.value) and "\n" not in str(error.value)
