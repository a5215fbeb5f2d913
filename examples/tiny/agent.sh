#!/usr/bin/env bash
# A tool-using agent on the tiny example, after examples/tiny/run.sh (same TINY_OUT): products of two two-digit
# numbers, which the SFT model (operands up to 9) cannot work out itself, with the `calculator` environment: a turn
# holding <calc>EXPRESSION</calc> gets the value back as a tool turn, a turn without a call is the final answer, scored
# by the exact-answer reward. SFT on the calculator's demonstrations, then on a mix in which most answers skip it (the
# SFT policy calls it only sometimes), then GRPO with the tool; prints the held-out tool-use success and final-answer
# accuracy before and after GRPO. About two minutes on one core.
#   bash examples/tiny/agent.sh [overrides for every stage]
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! command -v aligner >/dev/null; then
  source .venv/bin/activate
fi
T=${TINY_OUT:-runs/tiny}
SFT=$T/sft/checkpoints/step_000300
[ -d "$SFT" ] || { echo "run examples/tiny/run.sh first (no $SFT)" >&2; exit 1; }
common=(tokenizer.path=$T/tokenizer logging.progress=false "$@")

# the calculator's demonstrations: the call's format, copying the question's numbers into it and its value out (the
# copying takes most of the 500 steps: before ~350 the calls' numbers are mostly wrong)
aligner train sft run_dir=$T/agent_sft model.pretrained=$SFT data.train_path=$T/agent_sft.jsonl \
  trainer.max_steps=500 trainer.micro_batch_size=16 optim.warmup_steps=0 optim.scheduler=constant "${common[@]}"
# then a mix in which one conversation in five calls the calculator and the rest answer directly: the SFT policy
# (SFT_TOOL) calls it in about one sampled episode in ten
aligner train sft run_dir=$T/agent_mix model.pretrained=$T/agent_sft/checkpoints/step_000500 \
  data.train_path=$T/agent_mix.jsonl trainer.max_steps=60 trainer.micro_batch_size=16 optim.warmup_steps=0 \
  optim.scheduler=constant "${common[@]}"
SFT_TOOL=$T/agent_mix/checkpoints/step_000060

# GRPO with the calculator: 16 prompts x 8 episodes of up to 3 turns per step, 2 optimizer steps of 64; the
# environment scores each final answer with `arithmetic`; validation: greedy episodes on the 128 held-out prompts,
# their final answers' accuracy (val/reward/mean) and whether the first call computes the answer (calculator_call)
aligner train grpo run_dir=$T/agent_grpo model.pretrained=$SFT_TOOL data.train_path=$T/agent_train.jsonl \
  data.val_path=$T/agent_val.jsonl env.name=calculator env.max_turns=3 env.concurrency=1 reward.functions=[arithmetic] \
  reward.val_functions=[aligner.envs.tools:calculator_call] trainer.max_steps=30 trainer.val_interval=10 \
  algorithm.prompts_per_step=16 algorithm.num_generations=8 trainer.global_batch_size=64 trainer.micro_batch_size=64 \
  sampling.max_new_tokens=20 optim.lr=3e-4 optim.min_lr=3e-4 algorithm.kl.coef=0.01 "${common[@]}"

echo "--- the calculator agent: greedy episodes on $T/agent_val.jsonl, the SFT policy (step 0) and after GRPO ---"
python - "$T" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/agent_grpo/metrics.jsonl")]
val = [r for r in rows if "val/reward/mean" in r]
for r in val:
    print(f"step {r['step']:3d}: tool-use success {r['val/calculator_call/mean']:.3f}, final-answer accuracy "
          f"{r['val/reward/mean']:.3f}, calls per episode {r['val/episode/tool_calls_mean']:.2f}")
first, last = val[0], val[-1]
print(f"tool-use success {first['val/calculator_call/mean']:.3f} -> {last['val/calculator_call/mean']:.3f}, "
      f"final-answer accuracy {first['val/reward/mean']:.3f} -> {last['val/reward/mean']:.3f}")
steps = [r for r in rows if "reward/mean" in r]
print(f"sampled episodes, steps 1-5 -> last 5: reward/mean {sum(r['reward/mean'] for r in steps[:5]) / 5:.3f} -> "
      f"{sum(r['reward/mean'] for r in steps[-5:]) / 5:.3f}, calls per episode "
      f"{sum(r['episode/tool_calls_mean'] for r in steps[:5]) / 5:.2f} -> "
      f"{sum(r['episode/tool_calls_mean'] for r in steps[-5:]) / 5:.2f}, largest kl/mean "
      f"{max(r['kl/mean'] for r in steps):.3f}")
PY
echo "--- after GRPO, sampled episodes of the last step (prompt -> turns and tool turns | reward) ---"
python - "$T" <<'PY'
import json, sys
from pathlib import Path
last = sorted(Path(f"{sys.argv[1]}/agent_grpo/rollouts").glob("step_*.jsonl"))[-1]
for row in map(json.loads, last.read_text().splitlines()):
    print(f"{row['prompt']!r} -> {row['response']!r} | {row['score']}")
PY
