#!/usr/bin/env bash
# The built-in tiny example, end to end on a CPU: set up, build tokenizer + data, then SFT; from the SFT weights,
# GRPO (the `arithmetic` exact-answer reward, in the background) alongside reward model -> DPO -> generate with the
# DPO policy -> PPO (the reward model served with the critic); prints the greedy accuracy of GRPO, DPO and PPO on the
# same held-out prompts before and after, and PPO's reward before and after.
#   bash examples/tiny/run.sh [overrides for every training stage, e.g.
#                              launcher.nproc_per_node=2 model.tensor_model_parallel_size=2]
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! command -v aligner >/dev/null; then  # set up unless aligner is installed already
  bash scripts/setup.sh
  source .venv/bin/activate
fi
T=${TINY_OUT:-runs/tiny}  # where data, runs and generations go
python examples/tiny/prepare.py --out $T
common=(tokenizer.path=$T/tokenizer logging.progress=false "$@")

aligner train sft run_dir=$T/sft data.train_path=$T/sft_train.jsonl data.val_path=$T/sft_val.jsonl \
  trainer.max_steps=300 trainer.val_interval=100 trainer.save_interval=100 "${common[@]}"
SFT=$T/sft/checkpoints/step_000300

# GRPO, in the background on the other core (each rank is one thread) while the reward model, DPO and PPO train:
# 32 prompts x 8 samples per step, 4 optimizer steps of 64 samples each (so old log-probs are computed); DAPO's
# dynamic sampling replaces the groups whose 8 answers are all right or all wrong (they teach nothing)
aligner train grpo run_dir=$T/grpo model.pretrained=$SFT data.train_path=$T/rl_train.jsonl \
  data.val_path=$T/rl_val.jsonl reward.functions=[arithmetic] trainer.max_steps=150 trainer.val_interval=50 \
  algorithm.dynamic_sampling.enabled=true \
  algorithm.prompts_per_step=32 algorithm.num_generations=8 trainer.global_batch_size=64 trainer.micro_batch_size=64 \
  sampling.max_new_tokens=4 optim.lr=1e-4 optim.min_lr=1e-4 algorithm.kl.coef=0.01 "${common[@]}" > $T/grpo.log 2>&1 &
grpo=$!
trap 'kill $grpo 2>/dev/null || true' EXIT

# the reward model: right answers against near misses; centred, so each prompt's rewards sit near 0 (for PPO's critic)
aligner train rm run_dir=$T/rm model.pretrained=$SFT data.train_path=$T/pref_train.jsonl \
  data.val_path=$T/pref_val.jsonl trainer.max_steps=1600 trainer.val_interval=400 trainer.global_batch_size=32 \
  trainer.micro_batch_size=32 optim.lr=3e-4 optim.min_lr=3e-5 rm.center_coef=0.1 "${common[@]}"

# DPO on the same pairs, with an SFT term on the chosen answer (dpo.sft_weight, as NeMo-Aligner's and RPO's): plain
# DPO pushes the near misses down by lowering the right answers' likelihood too, and its greedy accuracy falls
aligner train dpo run_dir=$T/dpo model.pretrained=$SFT data.train_path=$T/pref_train.jsonl \
  data.val_path=$T/pref_val.jsonl trainer.max_steps=100 trainer.val_interval=100 optim.lr=5e-4 optim.min_lr=5e-5 \
  dpo.sft_weight=1.0 "${common[@]}"

# the DPO policy's greedy answers to the 256 held-out prompts of rl_val.jsonl (GRPO's validation set)
aligner generate --model $T/dpo/checkpoints/step_000100 --prompts $T/prompts.jsonl --out $T/generations.jsonl \
  sampling.greedy=true sampling.max_new_tokens=12

# PPO: the reward model above scores, served with the critic (initialised from it) by the service this run starts;
# 256 prompts x 1 sample per step, sampled at temperature 0.7, 2 epochs of 4 optimizer steps of 64; the first 10 of 50
# steps train only the critic; KL 0.5, under which the reward model's best policy is right more often than the SFT policy
aligner train ppo run_dir=$T/ppo model.pretrained=$SFT reward.checkpoint=$T/rm/checkpoints/step_001600 \
  data.train_path=$T/rl_train.jsonl data.val_path=$T/rl_val.jsonl reward.val_functions=[arithmetic] \
  trainer.max_steps=50 trainer.val_interval=25 algorithm.prompts_per_step=256 trainer.global_batch_size=64 \
  trainer.micro_batch_size=64 critic.trainer.global_batch_size=64 critic.trainer.micro_batch_size=64 \
  algorithm.critic_warmup_steps=10 sampling.max_new_tokens=4 sampling.temperature=0.7 optim.lr=1e-4 optim.min_lr=1e-4 \
  algorithm.kl.coef=0.5 algorithm.ppo_epochs=2 critic.optim.lr=3e-4 critic.optim.min_lr=3e-4 "${common[@]}"

wait $grpo || { echo "GRPO failed (exit $?): see $T/grpo.log" >&2; exit 1; }
echo "--- each stage's last step ---"
python - "$T" <<'PY'
import json, sys
for stage, keys in (("sft", ("loss", "val/loss")), ("rm", ("loss", "val/accuracy")), ("dpo", ("loss", "val/accuracy")),
                    ("grpo", ("reward/mean", "kl/mean")), ("ppo", ("reward/mean", "kl/mean"))):
    last = json.loads(open(f"{sys.argv[1]}/{stage}/metrics.jsonl").read().splitlines()[-1])
    shown = ", ".join(f"{k} {last[k]:.3f}" for k in keys if k in last)
    print(f"{stage:5s} step {last['step']:4d}: {shown}")
PY
echo "--- GRPO: greedy exact-answer accuracy on $T/rl_val.jsonl (val/reward/mean) ---"
python - "$T" <<'PY'
import json, sys
vals = [(r["step"], r["val/reward/mean"]) for r in map(json.loads, open(f"{sys.argv[1]}/grpo/metrics.jsonl"))
        if "val/reward/mean" in r]
print(f"before the first step: {vals[0][1]:.3f}; after step {vals[-1][0]}: {vals[-1][1]:.3f}")
PY
echo "--- DPO: greedy exact-answer accuracy on $T/rl_val.jsonl (the SFT policy: GRPO's step 0) ---"
python - "$T" <<'PY'
import json, sys
from aligner.rewards.math import arithmetic_verdict
prompts = [json.loads(line) for line in open(f"{sys.argv[1]}/prompts.jsonl")]
right = [arithmetic_verdict(g["response"], str(p["answer"])) or 0.0 for p, g in
         zip(prompts, map(json.loads, open(f"{sys.argv[1]}/generations.jsonl")))]
sft = next(r["val/reward/mean"] for r in map(json.loads, open(f"{sys.argv[1]}/grpo/metrics.jsonl")) if r["step"] == 0)
print(f"SFT policy: {sft:.3f}; DPO policy after step 100: {sum(right) / len(right):.3f}")
PY
echo "--- PPO: reward-model score and greedy exact-answer accuracy on $T/rl_val.jsonl (val/reward/mean, val/arithmetic_answer/mean) ---"
python - "$T" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/ppo/metrics.jsonl")]
vals = [r for r in rows if "val/reward/mean" in r]
steps = [r for r in rows if "reward/mean" in r]
mean = lambda rs: sum(r["reward/mean"] for r in rs) / len(rs)  # noqa: E731
for when, r in (("before the first step", vals[0]), (f"after step {vals[-1]['step']}", vals[-1])):
    print(f"{when}: reward {r['val/reward/mean']:.3f}, accuracy {r['val/arithmetic_answer/mean']:.3f}")
print(f"training reward/mean, steps 1-10 (critic warm-up: the SFT policy): {mean(steps[:10]):.3f}, last 10: "
      f"{mean(steps[-10:]):.3f}; largest kl/mean: {max(r['kl/mean'] for r in steps):.3f}")
PY
echo "--- DPO policy, greedy, the first 8 held-out prompts (prompt -> response | right answer) ---"
python - "$T" <<'PY'
import json, sys
prompts = [json.loads(line) for line in open(f"{sys.argv[1]}/prompts.jsonl")][:8]
for p, g in zip(prompts, map(json.loads, open(f"{sys.argv[1]}/generations.jsonl"))):
    print(f"{p['prompt']!r} -> {g['response']!r} | {p['answer']}")
PY
aligner report $T/sft $T/rm $T/dpo $T/grpo $T/ppo --out $T/report.html >/dev/null
echo "--- the curves of every stage, overlaid, with the configs' differences and GRPO's and PPO's rollouts ---"
echo "report: $T/report.html (open it in a browser; each stage also has <stage>/report.html)"

