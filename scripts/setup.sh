#!/usr/bin/env bash
# Creates .venv with aligner and its test dependencies (CPU torch). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
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
          "tests/test_server.py) need one: use a Python built with --enable-shared")
PY
