# The EPD services (broker, encoder, language, gateway) with CUDA, FlashInfer,
# CuPy and NIXL. Build context: the repository root.
#
# One CUDA major version throughout (12): this image, torch's cu129 wheel (pinned
# through PyTorch's index: PyPI's default torch is a CUDA 13 build), cupy-cuda12x
# and nixl's cu12 module. A devel image: FlashInfer compiles its kernels with nvcc
# on first use (the language service does it at start-up, before it says
# SERVING), and documents CUDA 12.9 and 13.0. Host driver: 575 or newer (docs/gpu.md).
FROM nvidia/cuda:12.9.1-cudnn-devel-ubuntu24.04

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1
RUN python3 -m venv /opt/venv

WORKDIR /opt/epd
COPY pyproject.toml README.md ./
COPY protos protos
COPY services services
COPY model_repository model_repository
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu129
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "torch>=2.8" \
 && pip install --no-cache-dir ".[gpu]"

EXPOSE 8000 50051 50061 50071
CMD ["epd", "--help"]
