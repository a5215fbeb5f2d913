#!/usr/bin/env bash
# The built-in tiny example, end to end on a CPU: set up, build tokenizer + data, train SFT.
#   bash examples/tiny/run.sh [extra overrides, e.g. launcher.nproc_per_node=2 model.tensor_model_parallel_size=2]
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup.sh
source .venv/bin/activate
python examples/tiny/prepare.py --out runs/tiny
aligner train sft run_dir=runs/tiny/sft data.train_path=runs/tiny/sft_train.jsonl \
  data.val_path=runs/tiny/sft_val.jsonl tokenizer.path=runs/tiny/tokenizer \
  trainer.max_steps=60 trainer.val_interval=20 trainer.save_interval=30 "$@"
tail -n 1 runs/tiny/sft/metrics.jsonl
