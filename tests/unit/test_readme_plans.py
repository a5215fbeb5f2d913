"""The planner tables in README.md and the recipes' READMEs are what `aligner plan` prints today.

A table is a ```text block whose first line is `$ aligner plan ...`; `$(grep -Ev '...' FILE)` in it stands
for FILE's overrides (one a line, comments and blank lines skipped), as a shell expands it. README's LoRA rows
(`FEWEST`) give the fewest nodes on which a run fits, fully fine-tuned and with LoRA: the layout a row names
must fit and the next shorter pipeline of the actor, or of the critic, must not. After a change to the
planner, `python -m tests.unit.test_readme_plans` rewrites every block and row with the current output."""
import contextlib
import functools
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

BLOCK = re.compile(r"```text\n(\$ aligner plan [^\n]*)\n(.*?)```", re.S)
OVERRIDES_FILE = re.compile(r"\$\(grep -Ev '[^']*' ([^)\s]+)\)")
READMES = [REPO / "README.md", *sorted((REPO / "examples").glob("*/README.md"))]


def overrides(path: str) -> str:
    lines = (REPO / path).read_text().splitlines()
    return " ".join(line.strip() for line in lines if line.strip() and not line.strip().startswith("#"))


def plan_output(command: str) -> tuple[int, str]:
    """What `command` ($ aligner plan ...) prints, run in this process."""
    from aligner.plan.cli import main

    argv = shlex.split(OVERRIDES_FILE.sub(lambda m: overrides(m.group(1)), command.removeprefix("$ ")))[2:]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def blocks() -> list[tuple[Path, str, str]]:
    return [(readme, m.group(1), m.group(2)) for readme in READMES for m in BLOCK.finditer(readme.read_text())]


def test_the_readmes_show_the_plans_the_issue_asks_for():
    commands = " ".join(command for _, command, _ in blocks())
    for needed in ("llama3_70b_ppo/ppo.overrides", "llama31_405b_sft_dpo/sft.overrides",
                   "llama31_405b_sft_dpo/dpo.overrides", "llama3_8b_sft_dpo/sft.overrides", "cluster.gpu=cpu",
                   "model.lora.rank=16"):
        assert needed in commands, needed


@pytest.mark.parametrize("readme,command,shown", blocks(), ids=lambda v: v.name if isinstance(v, Path) else None)
def test_a_readme_plan_is_the_planners_output(readme, command, shown):
    code, printed = plan_output(command)
    assert code == 0, printed  # every layout shown in a README fits
    assert printed.strip() == shown.strip(), f"{readme}: rerun `python -m tests.unit.test_readme_plans`"


# ---- LoRA against full fine-tuning: the fewest nodes of H100-80GB each fits on (README.md's table) ----------
# A row's label: (algorithm, overrides file, more overrides). Both at the model file's TP 8 (a node) and DP 1,
# so a model takes PP nodes; PPO's critic service its own critic PP nodes. LoRA: rank 16 on the four linears
# of actor and critic, the reference (and the reward model) their bases with the adapters off.
FEWEST = {
    "Llama-3-70B PPO, the recipe": ("ppo", "examples/llama3_70b_ppo/ppo.overrides", []),
    "Llama-3.1-405B PPO, the recipe with `model=llama31_405b`": ("ppo", "examples/llama3_70b_ppo/ppo.overrides",
                                                                 ["model=llama31_405b"]),
}
LORA = ["model.lora.rank=16", "reference.mode=null", "critic.lora.rank=16"]
LENGTHS = ["plan.prompt_length=512", "plan.response_length=351"]  # the 70B PPO block's mean lengths


def _plan(label: str, lora: bool, pp: int, cpp: int) -> dict:
    from aligner.plan.cli import plan  # why: as plan_output's main, imported where the plans run

    algorithm, path, more = FEWEST[label]
    return plan(algorithm, [*shlex.split(overrides(path)), *more, *(LORA if lora else []), *LENGTHS,
                            f"model.pipeline_model_parallel_size={pp}", f"cluster.nodes={pp}",
                            f"critic.parallel.pipeline_model_parallel_size={cpp}",
                            f"critic.launcher.nproc_per_node={8 * cpp}", f"cluster.service_nodes={cpp}"])


@functools.lru_cache(maxsize=None)
def _stages(label: str) -> list[int]:
    from aligner.plan.cli import compose  # why: as _plan's

    algorithm, path, more = FEWEST[label]
    layers = compose(algorithm, [*shlex.split(overrides(path)), *more]).model.num_layers
    return [d for d in range(1, layers + 1) if layers % d == 0]  # the pipeline sizes PP may take


def _over(result: dict, who: str) -> bool:
    """Whether `who` ("the trainer's" or "the critic service's") GPUs are short of memory."""
    return any(e.startswith(who) for e in result["errors"])


def fewest(label: str, lora: bool) -> tuple[int, int, float]:
    """(actor PP, critic PP, step seconds) of the fewest nodes that fit, searched."""
    stages = _stages(label)
    pp = next(p for p in stages if not _over(_plan(label, lora, p, stages[-1]), "the trainer's"))
    cpp = next(c for c in stages if not _over(_plan(label, lora, pp, c), "the critic service's"))
    return pp, cpp, _plan(label, lora, pp, cpp)["step_time_s"]


def checked(label: str, lora: bool, pp: int, cpp: int) -> float:
    """The step seconds at (pp, cpp), asserting that it fits and the next shorter pipelines do not."""
    stages = _stages(label)
    result = _plan(label, lora, pp, cpp)
    assert result["fits"], (label, lora, result["errors"])
    if pp > 1:
        assert _over(_plan(label, lora, stages[stages.index(pp) - 1], cpp), "the trainer's"), (label, lora, pp)
    if cpp > 1:
        assert _over(_plan(label, lora, pp, stages[stages.index(cpp) - 1]), "the critic service's"), (label, cpp)
    return result["step_time_s"]


def fewest_row(label: str, full: tuple[int, int, float], lora: tuple[int, int, float]) -> str:
    def cell(pp, cpp, step):
        return f"{pp} + {cpp} = {pp + cpp} (PP {pp}, critic PP {cpp}), {step:.0f} s"

    return f"| {label} | {cell(*full)} | {cell(*lora)} | {full[0] + full[1] - lora[0] - lora[1]} |"


ROW_LAYOUTS = re.compile(r"PP (\d+), critic PP (\d+)")


@pytest.mark.parametrize("label", FEWEST)
def test_a_lora_row_is_the_fewest_nodes_that_fit(label):
    line = next((line for line in (REPO / "README.md").read_text().splitlines() if line.startswith(f"| {label} |")),
                None)
    assert line is not None, f"README.md has no row {label!r}: rerun `python -m tests.unit.test_readme_plans`"
    (pp, cpp), (lpp, lcpp) = [tuple(map(int, m)) for m in ROW_LAYOUTS.findall(line)]
    full = (pp, cpp, checked(label, False, pp, cpp))
    lora = (lpp, lcpp, checked(label, True, lpp, lcpp))
    assert line == fewest_row(label, full, lora), "rerun `python -m tests.unit.test_readme_plans`"


# ---- separate rollout workers beside colocated generation (README.md's table) -----------------------------------
# A row's label: the run and its placement. PPO: the recipe's 70B (8 actor + 4 service nodes); GRPO: its actor's
# layout and lengths without the service (8 nodes, 128 prompts x 8), both at the 70B block's mean lengths.
PPO_70B = ["examples/llama3_70b_ppo/ppo.overrides", "cluster.nodes=8", "cluster.service_nodes=4", *LENGTHS]
GRPO_70B = ["model=llama3_70b", "model.seq_length=2048", "launcher.nproc_per_node=8", "optim.distributed_optimizer=true",
            "trainer.micro_batch_size=1", "trainer.global_batch_size=128", "algorithm.prompts_per_step=128",
            "algorithm.num_generations=8", "reference.mode=model", "data.max_length=1024",
            "sampling.max_new_tokens=1024", "generation.batch_size=128", "cluster.nodes=8", *LENGTHS]
WORKERS = ["generation.placement=separate", "generation.workers=4", "generation.tensor_model_parallel_size=8"]
PLACEMENTS = {
    "PPO, colocated (the recipe)": ("ppo", PPO_70B, []),
    "PPO, separate, 4 workers x TP 8, lag 0": ("ppo", PPO_70B, [*WORKERS, "algorithm.async.max_lag=0"]),
    "PPO, separate, 4 workers x TP 8, lag 1": ("ppo", PPO_70B, [*WORKERS, "algorithm.async.max_lag=1"]),
    "GRPO, colocated": ("grpo", GRPO_70B, []),
    "GRPO, separate, 4 workers x TP 8, lag 0": ("grpo", GRPO_70B, [*WORKERS, "algorithm.async.max_lag=0"]),
    "GRPO, separate, 4 workers x TP 8, lag 1": ("grpo", GRPO_70B, [*WORKERS, "algorithm.async.max_lag=1"]),
}
OVERLAPPED = ("generate_s", "broadcast_s", "critic_infer_s", "critic_train_s", "step_s")  # not the trainer's own


def placement_row(label: str) -> str:
    """| run | GPUs | generate | the trainer's phases | broadcast | step | (seconds), as the planner has them."""
    from aligner.plan.cli import plan  # why: as _plan's

    algorithm, base, placement = PLACEMENTS[label]
    run = [*shlex.split(overrides(base[0])), *base[1:]] if base[0].endswith(".overrides") else list(base)
    result = plan(algorithm, [*run, *placement])
    assert result["fits"], (label, result["errors"])
    t = result["timing"]
    trainer = sum(v for k, v in t.items() if k not in OVERLAPPED)
    return (f"| {label} | {result['cluster']['gpus']} | {t['generate_s']:.1f} s | {trainer:.1f} s | "
            f"{t.get('broadcast_s', 0.0):.1f} s | {t['step_s']:.1f} s |")


@pytest.mark.parametrize("label", PLACEMENTS)
def test_a_placement_row_is_the_planners(label):
    line = next((line for line in (REPO / "README.md").read_text().splitlines() if line.startswith(f"| {label} |")),
                None)
    assert line == placement_row(label), "rerun `python -m tests.unit.test_readme_plans`"


def rewrite() -> None:
    for readme in READMES:
        text = readme.read_text()
        new = BLOCK.sub(lambda m: f"```text\n{m.group(1)}\n{plan_output(m.group(1))[1].rstrip()}\n```", text)
        if readme.name == "README.md" and readme.parent == REPO:
            for label in FEWEST:
                row = fewest_row(label, fewest(label, False), fewest(label, True))
                new = re.sub(rf"^\| {re.escape(label)} \|.*$", lambda _: row, new, flags=re.M)
            for label in PLACEMENTS:
                row = placement_row(label)
                new = re.sub(rf"^\| {re.escape(label)} \|.*$", lambda _: row, new, flags=re.M)
        if new != text:
            readme.write_text(new)
            print(f"updated {readme}", file=sys.stderr)


if __name__ == "__main__":
    rewrite()
