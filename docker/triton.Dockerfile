# NVIDIA's Triton with the vit model's Python dependencies (torch, transformers
# and this project, for its vision-tower loader) in a venv that model.py adds
# to the Python backend's path. Release 24.12: Ubuntu 24.04, Python 3.12.
FROM nvcr.io/nvidia/tritonserver:24.12-py3

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3-venv curl \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/epd-venv

WORKDIR /opt/epd
COPY pyproject.toml README.md ./
COPY protos protos
COPY services services
COPY model_repository model_repository
# torch's CUDA 12 build, as in epd.Dockerfile (PyPI's default is a CUDA 13 one)
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu129
RUN /opt/epd-venv/bin/pip install --no-cache-dir --index-url "$TORCH_INDEX" "torch>=2.8" \
 && /opt/epd-venv/bin/pip install --no-cache-dir .

ENV EPD_SITE_PACKAGES=/opt/epd-venv/lib/python3.12/site-packages
