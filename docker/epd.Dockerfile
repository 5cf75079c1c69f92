# The EPD services (broker, encoder, language, gateway) with CUDA, FlashInfer,
# CuPy and NIXL. Build context: the repository root.
#
# One CUDA major version throughout (12): this image, torch's cu129 wheel (pinned
# through PyTorch's index: PyPI's default torch is a CUDA 13 build), cupy-cuda12x
# and nixl's cu12 module. FlashInfer's kernels come prebuilt for CUDA 12.9 in
# flashinfer-jit-cache (FlashInfer's own index; the exact release of the
# flashinfer-python that pyproject.toml pins); what it lacks FlashInfer compiles
# with nvcc on first use (the language service does so at start-up, before it
# says SERVING), hence a devel image, and compose keeps those builds in a volume
# (FLASHINFER_WORKSPACE_BASE). Host driver: 575 or newer (docs/gpu.md).
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
ARG FLASHINFER_INDEX=https://flashinfer.ai/whl/cu129
ARG FLASHINFER_VERSION=0.7.2.post1
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "torch>=2.8" \
 && pip install --no-cache-dir ".[gpu]" \
 && pip install --no-cache-dir --index-url "$FLASHINFER_INDEX" \
      "flashinfer-jit-cache==$FLASHINFER_VERSION"

EXPOSE 8000 50051 50061 50071
CMD ["epd", "--help"]
