#!/usr/bin/env bash
# LoRA on the tiny example, after examples/tiny/run.sh (same TINY_OUT): GRPO, DPO and PPO again from the same SFT
# checkpoint, each with rank-16 adapters on every decoder linear and the base frozen (PPO's critic too, on the reward
# model it starts from), printed beside the full-parameter runs' figures. About four minutes on two cores.
#   bash examples/tiny/lora.sh [overrides for every stage]
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! command -v aligner >/dev/null; then
  source .venv/bin/activate
fi
T=${TINY_OUT:-runs/tiny}
SFT=$T/sft/checkpoints/step_000300
[ -d "$SFT" ] || { echo "run examples/tiny/run.sh first (no $SFT)" >&2; exit 1; }
# adapters learn at a higher rate than full weights (their updates are scaled by alpha / rank and start from zero)
lora=(model.lora.rank=16 model.lora.alpha=32 tokenizer.path=$T/tokenizer logging.progress=false "$@")

# GRPO: the example's budget and settings, in the background on the other core
aligner train grpo run_dir=$T/grpo_lora model.pretrained=$SFT data.train_path=$T/rl_train.jsonl \
  data.val_path=$T/rl_val.jsonl reward.functions=[arithmetic] trainer.max_steps=150 trainer.val_interval=50 \
  algorithm.dynamic_sampling.enabled=true \
  algorithm.prompts_per_step=32 algorithm.num_generations=8 trainer.global_batch_size=64 trainer.micro_batch_size=64 \
  sampling.max_new_tokens=4 optim.lr=1e-3 optim.min_lr=1e-3 algorithm.kl.coef=0.01 "${lora[@]}" > $T/grpo_lora.log 2>&1 &
grpo=$!
trap 'kill $grpo 2>/dev/null || true' EXIT

aligner train dpo run_dir=$T/dpo_lora model.pretrained=$SFT data.train_path=$T/pref_train.jsonl \
  data.val_path=$T/pref_val.jsonl trainer.max_steps=100 trainer.val_interval=100 optim.lr=2e-3 optim.min_lr=2e-4 \
  dpo.sft_weight=1.0 "${lora[@]}"

aligner train ppo run_dir=$T/ppo_lora model.pretrained=$SFT reward.checkpoint=$T/rm/checkpoints/step_001600 \
  data.train_path=$T/rl_train.jsonl data.val_path=$T/rl_val.jsonl reward.val_functions=[arithmetic] \
  trainer.max_steps=50 trainer.val_interval=25 algorithm.prompts_per_step=256 trainer.global_batch_size=64 \
  trainer.micro_batch_size=64 critic.trainer.global_batch_size=64 critic.trainer.micro_batch_size=64 \
  algorithm.critic_warmup_steps=10 sampling.max_new_tokens=4 sampling.temperature=0.7 optim.lr=1e-3 optim.min_lr=1e-3 \
  algorithm.kl.coef=0.5 algorithm.ppo_epochs=2 critic.optim.lr=3e-3 critic.optim.min_lr=3e-3 \
  critic.lora.rank=16 critic.lora.alpha=32 "${lora[@]}"

wait $grpo || { echo "GRPO with LoRA failed (exit $?): see $T/grpo_lora.log" >&2; exit 1; }
echo "--- full-parameter training vs LoRA (rank 16), the same budgets ---"
python - "$T" <<'PY'
import json, sys
from pathlib import Path
T = sys.argv[1]
rows = lambda run: [json.loads(line) for line in open(f"{T}/{run}/metrics.jsonl")]  # noqa: E731
for name, run in (("full", "grpo"), ("LoRA", "grpo_lora")):
    acc = [r["val/reward/mean"] for r in rows(run) if "val/reward/mean" in r]
    print(f"GRPO {name:4s}: greedy accuracy {acc[0]:.3f} -> {acc[-1]:.3f} ({acc[-1] - acc[0]:+.3f}), "
          f"largest kl/mean {max(r.get('kl/mean', 0) for r in rows(run)):.3f}")
for name, run in (("full", "dpo"), ("LoRA", "dpo_lora")):
    print(f"DPO  {name:4s}: validation pair accuracy {rows(run)[-1]['val/accuracy']:.3f}")
for name, run in (("full", "ppo"), ("LoRA", "ppo_lora")):
    val = [r for r in rows(run) if "val/reward/mean" in r]
    print(f"PPO  {name:4s}: reward-model score {val[0]['val/reward/mean']:.3f} -> {val[-1]['val/reward/mean']:.3f}, "
          f"greedy accuracy {val[0]['val/arithmetic_answer/mean']:.3f} -> {val[-1]['val/arithmetic_answer/mean']:.3f}, "
          f"largest kl/mean {max(r.get('kl/mean', 0) for r in rows(run)):.3f}")
size = lambda run: sum(p.stat().st_size for p in Path(f"{T}/{run}/checkpoints/step_000100/weights").rglob("*"))  # noqa
print(f"DPO checkpoint weights: full {size('dpo') / 1e6:.1f} MB (weights + Adam), LoRA {size('dpo_lora') / 1e6:.2f} MB "
      f"(adapters + their Adam; the base is named, not copied)")
PY
