#!/usr/bin/env bash
# Creates .venv with aligner and its test dependencies (CPU torch). Idempotent.
#   bash scripts/setup.sh           the Python environment
#   bash scripts/setup.sh --tests   also the Debian packages the tests use (as root, with apt-get): Chromium for
#                                   the report's browser test, Slurm for the local-cluster tests
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--tests" ]; then
  if ! command -v chromium >/dev/null; then
    command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] \
      || { echo "setup.sh --tests: install Debian's chromium (root and apt-get are needed here)" >&2; exit 1; }
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  fi
  bash scripts/slurm_local.sh install
fi
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
source .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build of torch first (a plain `torch` requirement would pull the multi-GB CUDA build).
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
python - <<'PY'
import sysconfig, torch, megatron.core
print(f"aligner env ready: torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
      f"shared libpython: {bool(sysconfig.get_config_var('Py_ENABLE_SHARED'))}")
if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
    print("warning: this Python has no shared libpython; the PyTriton servers (aligner serve, "
          "tests/integration/test_server.py) need one: use a Python built with --enable-shared")
PY
