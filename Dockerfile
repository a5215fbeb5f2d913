# GPU image for aligner: NVIDIA's PyTorch container (CUDA, NCCL, Transformer Engine, apex prebuilt).
# TensorRT-LLM is not part of this image; see README ("GPU hosts").
FROM nvcr.io/nvidia/pytorch:25.09-py3
WORKDIR /opt/aligner
COPY pyproject.toml README.md LICENSE ./
COPY aligner ./aligner
COPY conf ./conf
COPY slurm ./slurm
COPY examples ./examples
# Keep the container's torch / TE builds: install our other dependencies only.
RUN pip install --no-cache-dir -e . && aligner doctor
ENV CUDA_DEVICE_MAX_CONNECTIONS=1
