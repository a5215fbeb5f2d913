#!/usr/bin/env bash
# The device acceptance kit, on a lent GPU machine (no network; its python3 holds torch 2.11+cu130 and transformers).
# Installs what the call carried from .whl/ (scripts/device/wheels.sh built it here) into a temporary target with
# --no-index, puts that and this tree on PYTHONPATH (aligner runs from the tree: no install), then runs
# bench/accept.py --out $OUT within 9 minutes (a device call may take 10). Arguments pass through:
#   bash scripts/device/accept.sh --commit SHA                   every check (carry [.whl/core, .whl/peer, .whl/fp8])
#   bash scripts/device/accept.sh --commit SHA --only ppo        PPO (carry [.whl/core, .whl/ppo])
#   bash scripts/device/accept.sh --commit SHA --only sft mfu    rerun some checks into the same accept.json
# The tree travels without .git: pass the commit that was sent (git rev-parse HEAD here) with --commit.
set -uo pipefail
cd "$(dirname "$0")/../.."
SITE=${ALIGNER_SITE:-/tmp/site}
shopt -s nullglob
wheels=(.whl/*/*.whl)
tarballs=(.whl/*/*.tar.xz)
if [ ${#wheels[@]} -eq 0 ]; then
  echo "error: no wheels under .whl/: run scripts/device/wheels.sh here, then carry .whl/core (and the others)" >&2
  exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" \
  || exit 2
for t in "${tarballs[@]}"; do tar -xJf "$t" -C "$SITE" || exit 2; done  # PyTriton: its installed tree, xz-packed
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # no network there: never wait on the Hub
[ -d .whl/peer/bench-trl ] && export ALIGNER_TRL_BENCH_DIR="$PWD/.whl/peer/bench-trl"
timeout -k 15 540 python3 bench/accept.py --out "${OUT:-runs/accept}" --budget 480 "$@"  # its zygote's start counted
