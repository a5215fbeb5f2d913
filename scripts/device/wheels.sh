#!/usr/bin/env bash
# The files the device acceptance kit carries to a lent GPU machine, which has Python 3.12, torch 2.11+cu130,
# transformers 5.x and no network: the cp312 manylinux x86_64 wheels of what its image lacks, in .whl/ (ignored
# by git), one folder per group, with .whl/MANIFEST.tsv (group, file, bytes, sha256) and a size check per call.
#   bash scripts/device/wheels.sh            (here, with network; about 2 minutes the first time)
# Groups:
#   core  aligner's own dependencies missing there: megatron-core, hydra-core, omegaconf, antlr4 (an sdist at
#         4.9.3, built here into a pure-python wheel), math-verify and its parser. plotly is left out: without
#         it a run only skips its report.html (a warning), and it would cost 10 MB.
#   peer  the TRL peer comparison: trl and what of its dependencies the image lacks (datasets, dill,
#         multiprocess), plus the peer baseline's own scripts (bench-trl/: common.py, bench_grpo.py,
#         setup_artifacts.py, copied from ALIGNER_TRL_BENCH_DIR, default ../shared/reference/bench-trl).
#   fp8   NVIDIA ModelOpt for the FP8 export test of `pytest -m gpu`: nvidia-modelopt and its missing
#         dependencies (pulp alone is 16 MB: modelopt's quantization imports it).
#   ppo   PyTriton for the PPO check: its 55 MB wheel repacked as an xz tarball of the installed tree (34 MB;
#         accept.sh unpacks it into the install target) and its missing dependencies.
# Calls (what one device call carries, each under 50 MiB; the tool's limit is 64 MiB with the working tree):
#   main  core, peer, fp8     every check but PPO
#   ppo   core, ppo           `--only ppo`: PyTriton does not fit beside peer and fp8 (about 65 MiB together)
# numpy: aligner pins numpy<2 (for PyTriton); the kit uses the image's numpy 2 rather than carry 18 MB of numpy 1.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
W=.whl
BASELINE=${ALIGNER_TRL_BENCH_DIR:-../shared/reference/bench-trl}
PLATFORMS=()
for n in 2_5 2_17 2_24 2_26 2_27 2_28 2_31 2_34 2_35; do PLATFORMS+=(--platform "manylinux_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

download() {  # download GROUP NAME==VERSION...
  local dest=$W/$1; shift
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$dest" "$@"
}

rm -rf "$W/core" "$W/peer" "$W/fp8"
mkdir -p "$W/core" "$W/peer/bench-trl" "$W/fp8" "$W/ppo"

download core megatron-core==0.16.1 hydra-core==1.3.8 omegaconf==2.3.1 math-verify==0.9.0 \
  latex2sympy2_extended==1.11.0
"$PY" -m pip wheel -q --no-deps -w "$W/core" antlr4-python3-runtime==4.9.3

download peer trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
for f in common.py bench_grpo.py setup_artifacts.py; do cp "$BASELINE/$f" "$W/peer/bench-trl/"; done

download fp8 nvidia-modelopt==0.37.0 pulp==3.3.2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 torchprofile==0.1.0

find "$W/ppo" -name '*.whl' -delete
download ppo tritonclient==2.73.0 pyzmq==27.3.0 sh==2.4.0 gevent==26.9.0 geventhttpclient==2.6.1 greenlet==3.3.2 \
  zope.event==6.2 zope.interface==8.7 python-rapidjson==1.25 brotli==1.2.1 importlib-metadata==10.2.0
tarball=$W/ppo/nvidia_pytriton-0.7.0.tar.xz
if [ ! -s "$tarball" ]; then  # xz -9 takes ~2 minutes on 2 cores; kept between runs
  tmp=$(mktemp -d)
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$tmp/wheel" nvidia-pytriton==0.7.0
  (cd "$tmp" && mkdir tree && cd tree && unzip -q ../wheel/*.whl)
  tar -C "$tmp/tree" -cf - . | xz -9 -T0 > "$tarball.part"
  mv "$tarball.part" "$tarball"
  rm -rf "$tmp"
fi

"$PY" scripts/device/manifest.py "$W" --call main=core,peer,fp8 --call ppo=core,ppo --limit-mib 50
