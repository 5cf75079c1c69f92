# The EPD services (broker, encoder, language, gateway) with CUDA, FlashInfer,
# CuPy and NIXL. Build context: the repository root.
FROM nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04

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
RUN pip install --no-cache-dir ".[gpu]"

EXPOSE 8000 50051 50061 50071
CMD ["epd", "--help"]
