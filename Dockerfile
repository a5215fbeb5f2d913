# syntax=docker/dockerfile:1
# GPU image for aligner: Python 3.12, CUDA 13.1, torch, Transformer Engine, NCCL, TensorRT-LLM, PyTriton and
# ModelOpt. The base is TensorRT-LLM's release container, which is NVIDIA's PyTorch container
# (BASE_NGC_PYTORCH below) with TensorRT-LLM built against that container's own torch; the TensorRT-LLM wheel
# on NVIDIA's index is built against upstream torch 2.9.1 and is not meant for the NGC container's newer one.
# Nothing third-party is rebuilt or patched: torch, Transformer Engine, NCCL and CUDA are the base's, and
# the build stops if they are not the versions below.
#
# Every version is pinned here once, as an ARG; tests/unit/test_dockerfile.py checks them against pyproject.toml's
# extras and README's "GPU image versions" table: change the three together.
#   docker build -t aligner:gpu .
ARG TENSORRT_LLM_VERSION=1.2.1
FROM nvcr.io/nvidia/tensorrt-llm/release:${TENSORRT_LLM_VERSION}

ARG TENSORRT_LLM_VERSION
# What the base must hold (checked below): TensorRT-LLM 1.2 is built on NGC PyTorch 25.12.
ARG BASE_NGC_PYTORCH=25.12-py3
ARG BASE_TORCH=2.10.0a0
ARG BASE_CUDA=13.1
ARG BASE_PYTHON=3.12
ARG TRANSFORMER_ENGINE_SPEC=">=2.9,<2.12"
# What this image adds (pip pins).
ARG MEGATRON_CORE_VERSION=0.16.1
ARG PYTRITON_VERSION=0.7.0
ARG MODELOPT_VERSION=0.37.0

# NGC's /etc/pip/constraint.txt pins the base's own package set; the pins in this file are the constraints.
ENV PIP_CONSTRAINT= \
    CUDA_DEVICE_MAX_CONNECTIONS=1

RUN python - "$TENSORRT_LLM_VERSION" "$BASE_TORCH" "$BASE_CUDA" "$BASE_PYTHON" "$TRANSFORMER_ENGINE_SPEC" <<'CHECK'
import sys
from importlib.metadata import version

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

trtllm, torch_version, cuda, python, te_spec = sys.argv[1:]
found = {"tensorrt-llm": version("tensorrt_llm"), "torch": torch.__version__, "CUDA": torch.version.cuda or "none",
         "python": "%d.%d" % sys.version_info[:2], "transformer-engine": version("transformer_engine")}
checks = [("tensorrt-llm", trtllm, found["tensorrt-llm"] == trtllm),
          ("torch", torch_version, Version(found["torch"]).public == torch_version),
          ("CUDA", cuda, found["CUDA"].startswith(cuda)),
          ("python", python, found["python"] == python),
          ("transformer-engine", te_spec,
           SpecifierSet(te_spec).contains(Version(found["transformer-engine"]).base_version))]
wrong = [f"{name} {found[name]} (expected {want})" for name, want, ok in checks if not ok]
if wrong:
    sys.exit("the base image is not the one this Dockerfile was written for: " + "; ".join(wrong))
print("base image:", ", ".join(f"{name} {v}" for name, v in found.items()))
CHECK

WORKDIR /opt/aligner
COPY pyproject.toml README.md LICENSE ./
COPY aligner ./aligner
COPY conf ./conf
COPY slurm ./slurm
COPY examples ./examples
# aligner with its PyTriton servers and ModelOpt export; torch, TE and TensorRT-LLM stay the base's.
RUN pip install --no-cache-dir -e ".[serve,modelopt]" \
        "megatron-core==${MEGATRON_CORE_VERSION}" \
        "nvidia-pytriton==${PYTRITON_VERSION}" \
        "nvidia-modelopt==${MODELOPT_VERSION}"
RUN aligner doctor
